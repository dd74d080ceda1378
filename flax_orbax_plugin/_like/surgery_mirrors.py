"""Surgery in items that mirror params: an optimizer state's moments.

``surgery=[...]`` is written against params' leaf paths (``layers_{i}/kernel``). An
optimizer state holds trees of the same shape under prefixes of its own (Adam's
``0/mu/`` and ``0/nu/``), so a resume into a changed model needs the same operations
there. :func:`mirrored` gives, for one item's saved leaf paths, every operation at
every prefix under which its leaves appear (the empty prefix included: an item that
holds params' paths itself); an operation that matches nowhere in such an item does
nothing there (params, restored with the operations as given, still refuses one that
matches nothing). Pure functions; any thread.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from .surgery_ops import Fuse, Rename, Split, Stack, Transpose, Unstack

__all__ = ["mirrored"]

_NUMBER = "(?:0|[1-9][0-9]*)"
# The fields of each operation that hold paths (patterns with {i} included).
_PATHS = {
    Stack: ("target", "sources"),
    Unstack: ("source", "targets"),
    Fuse: ("target", "sources"),
    Split: ("source", "targets"),
    Transpose: ("path",),
    Rename: ("old", "new"),
}


def mirrored(ops: tuple[Any, ...], paths: Iterable[str]) -> tuple[Any, ...]:
    """``ops`` as they apply to an item whose saved leaves are ``paths``: each at every
    prefix (``''`` or ending in ``'/'``) under which what it reads is found, in order
    (the leaves an earlier operation makes count for the later ones)."""
    known = set(paths)
    out: list[Any] = []
    for op in ops:
        for prefix in sorted(_prefixes(op, known)):
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


def _prefixes(op: Any, known: set[str]) -> set[str]:
    regex = re.compile(r"((?:[^/]+/)*?)" + _reads(op))
    return {m.group(1) for path in known if (m := regex.fullmatch(path))}


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
