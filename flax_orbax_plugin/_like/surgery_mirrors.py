"""Surgery in items that mirror params: an optimizer state's moments.

``surgery=[...]`` is written against params' paths; an optimizer state holds trees of
the same shape under prefixes of its own (Adam's ``0/mu/``). :func:`mirrored` gives
every operation at every prefix where it matches (``''`` included); one matching
nowhere does nothing there (params still refuse it). Pure functions; any thread.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from .surgery_ops import Fuse, Rename, Split, Stack, Transpose, Unstack

__all__ = ["mirrored"]

_NUMBER = "(?:0|[1-9][0-9]*)"
_PATHS = {
    Stack: ("target", "sources"),
    Unstack: ("source", "targets"),
    Fuse: ("target", "sources"),
    Split: ("source", "targets"),
    Transpose: ("path",),
    Rename: ("old", "new"),
}


def mirrored(ops: tuple[Any, ...], paths: Iterable[str]) -> tuple[Any, ...]:
    """``ops`` at every prefix of ``paths`` where what each reads is found, in order (an
    earlier operation's leaves count for the later ones)."""
    known = set(paths)
    out: list[Any] = []
    for op in ops:
        regex = re.compile(r"((?:[^/]+/)*?)" + _reads(op))
        for prefix in sorted({m.group(1) for path in known if (m := regex.fullmatch(path))}):
            moved = _moved(op, prefix)
            out.append(moved)
            known.update(_made(moved))
    return tuple(out)


def _reads(op: Any) -> str:
    """A regex of the first leaf path (or prefix) ``op`` reads."""
    if isinstance(op, Stack):
        first = op.sources if isinstance(op.sources, str) else op.sources[0]
    elif isinstance(op, Fuse):
        first = op.sources[0]
    else:
        first = getattr(op, "source", None) or getattr(op, "path", None) or op.old
    head, _, tail = first.partition("{i}")
    regex = re.escape(head) + (_NUMBER + re.escape(tail) if "{i}" in first else "")
    return regex + (".*" if first.endswith("/") else "")


def _moved(op: Any, prefix: str) -> Any:
    if not prefix:
        return op
    fields = {}
    for name in _PATHS[type(op)]:
        value = getattr(op, name)
        fields[name] = (
            prefix + value if isinstance(value, str) else tuple(prefix + v for v in value)
        )
    return dataclasses.replace(op, **fields)


def _made(op: Any) -> list[str]:
    """The leaf paths ``op`` makes that later operations may read (no pattern)."""
    if isinstance(op, (Stack, Fuse)):
        return [op.target]
    if isinstance(op, Split):
        return list(op.targets)
    if isinstance(op, Rename):
        return [op.new]
    return []
