"""Where in a JSON document a refusal of ``local_files.parse`` or ``encode`` points: the
key of a refused number, the first string UTF-8 cannot encode. Pure functions: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.local_files``.
"""

from __future__ import annotations

import re
from typing import Any

_KEY_BEFORE = re.compile(rb'"([^"\\]{1,64})"\s*:\s*[\[\s]*$')


def field_before(raw: bytes, text: str) -> str:
    """The key under which the number ``text`` first appears in ``raw`` (for the error
    message), else its byte offset."""
    at = raw.find(text.encode())
    if at < 0:
        return "?"
    match = _KEY_BEFORE.search(raw[max(0, at - 200) : at])
    return match.group(1).decode(errors="replace") if match else f"at byte {at}"


def unencodable(value: Any) -> tuple[str, str] | None:
    """(where in ``value``, the text) of the first str (key or value) that UTF-8 cannot
    encode (a lone surrogate), or None. Walked without recursion."""
    stack: list[tuple[Any, str]] = [(value, "the value")]
    while stack:
        x, at = stack.pop()
        if isinstance(x, str):
            if not _encodes(x):
                return at, _shown(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                if isinstance(k, str) and not _encodes(k):
                    return f"the key {_shown(k)!r} of {at}", _shown(k)
                stack.append((v, f"{at}[{k!r}]"[:200]))
        elif isinstance(x, list | tuple):
            stack.extend((v, f"{at}[{i}]"[:200]) for i, v in enumerate(x))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."
