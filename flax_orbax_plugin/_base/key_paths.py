"""A leaf's path as text: key entries joined by '/', '%' and '/' escaped in each.

Without JAX: a reader of records (``flax-orbax list``) imports none for them.
"""

from __future__ import annotations

from typing import Any

KeyEntry = tuple[str, Any]  # ("dict" | "seq" | "attr" | "flat", key)


def escape(part: Any) -> str:
    """One key as a path component: '%' and '/' escaped, so that a path names one leaf."""
    text = str(part)
    if "%" in text or "/" in text:
        text = text.replace("%", "%25").replace("/", "%2F")
    return text


def path_string(keys: list[KeyEntry] | tuple[KeyEntry, ...]) -> str:
    """The display and matching form of a key path."""
    return "/".join(escape(k) for _, k in keys) if keys else "<root>"
