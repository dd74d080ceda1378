"""The operations of layout surgery (``surgery=[...]``): frozen records that check their
own fields when made (TransformError naming the field). Threading: immutable; any thread.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

from .._errors import TransformError

__all__ = ["Stack", "Unstack", "Fuse", "Split", "Transpose", "Rename", "OPS"]


def _is_path(value: Any) -> bool:
    return isinstance(value, str) and bool(value) and not value.startswith("/")


def _need(op: Any, name: str, ok: bool, expected: str, found: Any) -> None:
    if not ok:
        raise TransformError(
            f"surgery {type(op).__name__}: {name} must be {expected}, found {found!r}"
        )


def _is_int(value: Any) -> bool:
    """An int, numpy's too; never a bool (True is no axis) nor a float (1.0 is none)."""
    return hasattr(value, "__index__") and type(value).__name__ not in ("bool", "bool_")


def _need_axis(op: Any, axis: Any) -> None:
    """An int (numpy's too, kept as Python's int on ``op``)."""
    _need(op, "axis", _is_int(axis), "an int", axis)
    object.__setattr__(op, "axis", operator.index(axis))


def _ints(values: Any) -> tuple[int, ...] | None:
    """``values`` (a list or tuple of ints, numpy's too) as Python ints, else None."""
    if not isinstance(values, (list, tuple)) or not all(map(_is_int, values)):
        return None
    return tuple(operator.index(v) for v in values)


def _need_paths(op: Any, name: str, expected: str = "a list of leaf paths") -> None:
    """Field ``name`` of ``op``: a non-empty list of distinct leaf paths (kept as a tuple)."""
    paths = getattr(op, name)
    ok = isinstance(paths, (list, tuple)) and len(paths) >= 1 and all(map(_is_path, paths))
    _need(op, name, ok, expected, paths)
    paths = tuple(paths)
    object.__setattr__(op, name, paths)
    twice = sorted({p for p in paths if paths.count(p) > 1})
    where = f" ({twice[0]!r} is there twice)" if twice else ""
    _need(op, name, not twice, "distinct leaf paths" + where, list(paths))


def _need_prefix_pair(op: Any, a: str, b: str, names: tuple[str, str]) -> None:
    ok = a.endswith("/") == b.endswith("/")
    _need(op, names[1], ok, f"a prefix ending in '/' exactly when {names[0]} is one", b)


@dataclasses.dataclass(frozen=True)
class Stack:
    """``target`` = the leaves ``sources`` names stacked along a new axis ``axis``:
    ``sources`` a pattern with ``{i}`` (``"layers_{i}/kernel"``, layers 0..N-1, all
    present) or a list of paths. Prefixes (``Stack("layers/", "layers_{i}/")``) stack
    every leaf under them."""

    target: str
    sources: str | Sequence[str]
    axis: int = 0

    def __post_init__(self):
        _need(self, "target", _is_path(self.target), "a leaf path", self.target)
        if isinstance(self.sources, str):
            ok = self.sources.count("{i}") == 1
            _need(self, "sources", ok, "a pattern with {i} (once)", self.sources)
            _need_prefix_pair(self, self.target, self.sources, ("target", "sources"))
        else:
            _need_paths(self, "sources", "a pattern with {i} or a list of paths")
        _need_axis(self, self.axis)


@dataclasses.dataclass(frozen=True)
class Unstack:
    """The leaf ``source`` cut along ``axis`` into ``targets`` (a pattern with
    ``{i}``: entry ``i`` of that axis); prefixes unstack every leaf under them."""

    source: str
    targets: str
    axis: int = 0

    def __post_init__(self):
        _need(self, "source", _is_path(self.source), "a leaf path", self.source)
        ok = isinstance(self.targets, str) and self.targets.count("{i}") == 1
        _need(self, "targets", ok, "a pattern with {i} (once)", self.targets)
        _need_prefix_pair(self, self.source, self.targets, ("source", "targets"))
        _need_axis(self, self.axis)


@dataclasses.dataclass(frozen=True)
class Fuse:
    """``target`` = the leaves ``sources`` (paths, in order) concatenated along
    ``axis`` (fused QKV)."""

    target: str
    sources: Sequence[str]
    axis: int

    def __post_init__(self):
        _need(self, "target", _is_path(self.target), "a leaf path", self.target)
        _need_paths(self, "sources")
        _need_axis(self, self.axis)


@dataclasses.dataclass(frozen=True)
class Split:
    """The leaf ``source`` cut along ``axis`` into ``targets`` (paths, in order) of
    ``sizes`` along that axis (None: equal parts)."""

    source: str
    targets: Sequence[str]
    axis: int
    sizes: Sequence[int] | None = None

    def __post_init__(self):
        _need(self, "source", _is_path(self.source), "a leaf path", self.source)
        _need_paths(self, "targets")
        _need_axis(self, self.axis)
        if self.sizes is not None:
            sizes = _ints(self.sizes)
            ok = sizes is not None and len(sizes) == len(self.targets) and min(sizes) >= 0
            expected = f"{len(self.targets)} ints >= 0 (one per target)"
            _need(self, "sizes", ok, expected, self.sizes)
            object.__setattr__(self, "sizes", sizes)


@dataclasses.dataclass(frozen=True)
class Transpose:
    """The leaf ``path`` transposed in place: axis ``d`` becomes saved axis ``axes[d]``."""

    path: str
    axes: Sequence[int]

    def __post_init__(self):
        _need(self, "path", _is_path(self.path), "a leaf path", self.path)
        axes = _ints(self.axes)  # (1.0, 0.0) equals a permutation, and is none
        ok = axes is not None and sorted(axes) == list(range(len(axes)))
        _need(self, "axes", ok, "a permutation of 0..ndim-1 (ints)", self.axes)
        object.__setattr__(self, "axes", axes)


@dataclasses.dataclass(frozen=True)
class Rename:
    """The leaf ``old`` (or every leaf under the prefix ``old/``) named ``new``."""

    old: str
    new: str

    def __post_init__(self):
        _need(self, "old", _is_path(self.old), "a leaf path", self.old)
        _need(self, "new", _is_path(self.new), "a leaf path", self.new)
        _need_prefix_pair(self, self.old, self.new, ("old", "new"))


OPS = (Stack, Unstack, Fuse, Split, Transpose, Rename)
