"""A leaf's path as text: key entries joined by '/', '%' and '/' escaped in each.

Without JAX: a reader of records (``flax-orbax list``) imports none for them.
"""

from __future__ import annotations

from typing import Any

KeyEntry = tuple[str, Any]  # ("dict" | "seq" | "attr" | "flat", key)


def path_string(keys: list[KeyEntry] | tuple[KeyEntry, ...]) -> str:
    """The display and matching form of a key path: each key's text, '%' and '/' escaped
    (so that a path names one leaf), joined by '/'."""
    if not keys:
        return "<root>"
    return "/".join(str(k).replace("%", "%25").replace("/", "%2F") for _, k in keys)
