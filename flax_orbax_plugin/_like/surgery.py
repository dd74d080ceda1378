"""Layout surgery on restore (``surgery=[...]``): the operations (frozen records that
check their own fields), declared on the saved records and read through the nodes they
make, never run on data; the plan a ``dry_run`` returns.

``check_surgery`` where the option enters; :func:`mirrored` (an item that mirrors
params) and ``apply`` after ``transform=``. Pure; immutable; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.surgery``.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .._base import shown as _shown
from .._errors import TransformError
from .._format.layout import LeafRecord


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

# -- in items that mirror params: ``surgery=[...]`` is written against params' paths;
# an operation matching nowhere does nothing there (params still refuse it).

_NUMBER = "(0|[1-9][0-9]*)"
_PATHS = {  # the fields of an operation's paths: (what it reads, what it makes)
    Stack: ("sources", "target"),
    Unstack: ("source", "targets"),
    Fuse: ("sources", "target"),
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
        fields = _PATHS[type(op)]
        first = getattr(op, fields[0])
        first = first if isinstance(first, str) else first[0]  # a leaf path or prefix it reads
        head, _, tail = first.partition("{i}")
        reads = re.escape(head) + (_NUMBER + re.escape(tail) if "{i}" in first else "")
        regex = re.compile(r"((?:[^/]+/)*?)" + reads + (".*" if first.endswith("/") else ""))
        for prefix in sorted({m.group(1) for path in known if (m := regex.fullmatch(path))}):
            moved = dataclasses.replace(op, **{f: _under(prefix, getattr(op, f)) for f in fields})
            out.append(moved)
            if not isinstance(moved, Unstack):  # (an Unstack makes a pattern, no path)
                made = getattr(moved, fields[-1])
                known.update([made] if isinstance(made, str) else made)
    return tuple(out)


def _under(prefix: str, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
    return prefix + value if isinstance(value, str) else tuple(prefix + v for v in value)


def check_surgery(value: Any) -> tuple[Any, ...]:
    """``surgery=`` as a tuple of operations (None: none); else TransformError naming it."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise TransformError(
            f"surgery must be a list of fop.Stack/Unstack/Fuse/Split/Transpose/Rename, "
            f"found {type(value).__name__}"
        )
    for k, op in enumerate(value):
        if not isinstance(op, OPS):
            raise TransformError(
                f"surgery[{k}]: expected fop.Stack, Unstack, Fuse, Split, Transpose or "
                f"Rename, found {op!r}"
            )
    return tuple(value)


# -- what a leaf is made of after surgery: a node has a shape and a dtype and answers
# Node.pieces: for a box of itself (((lo, hi), ...)), the saved leaves' boxes to read and
# the function assembling their arrays into the box's. Nodes compose, so every target
# shard reads exactly the saved regions it covers. Pure numpy, no reads.
Box = tuple[tuple[int, int], ...]
Assemble = Callable[[list[np.ndarray]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of one saved leaf: ``index`` its leaf number, ``record`` its record."""

    index: int
    record: Any
    box: Box


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def _join(plans: list[tuple[list[Piece], Assemble]], combine) -> tuple[list[Piece], Assemble]:
    """One piece list for several sub-plans; ``combine`` gets their assembled arrays."""
    pieces: list[Piece] = []
    spans = []
    for sub, assemble in plans:
        spans.append((len(pieces), len(sub), assemble))
        pieces.extend(sub)

    def assemble_all(arrays: list[np.ndarray]) -> np.ndarray:
        return combine([asm(arrays[s : s + n]) for s, n, asm in spans])

    return pieces, assemble_all


def _nothing(box: Box, dtype: str) -> tuple[list[Piece], Assemble]:
    """An empty box: nothing read, an empty array of its shape."""
    shape = [h - low for low, h in box]
    return [], lambda arrays: np.empty(shape, dtype)


class Node:
    """A leaf as surgery makes it; its dtype is that of ``node`` or the first of ``parts``."""

    shape: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return (self.parts[0] if hasattr(self, "parts") else self.node).dtype

    def pieces(self, box: Box) -> tuple[list[Piece], Assemble]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Saved(Node):
    """A saved leaf as it is."""

    index: int
    record: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.record.shape)

    @property
    def dtype(self) -> str:
        return self.record.dtype

    def pieces(self, box: Box) -> tuple[list[Piece], Assemble]:
        return [Piece(self.index, self.record, box)], lambda arrays: arrays[0]


@dataclasses.dataclass(frozen=True)
class Stacked(Node):
    """``parts`` (one shape and dtype) stacked along a new axis ``axis``."""

    parts: tuple[Node, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        inner = list(self.parts[0].shape)
        inner.insert(self.axis, len(self.parts))
        return tuple(inner)

    def pieces(self, box: Box) -> tuple[list[Piece], Assemble]:
        lo, hi = box[self.axis]
        inner = box[: self.axis] + box[self.axis + 1 :]
        if lo == hi:
            return _nothing(box, self.dtype)
        plans = [self.parts[i].pieces(inner) for i in range(lo, hi)]
        return _join(plans, lambda arrays: np.stack(arrays, axis=self.axis))


@dataclasses.dataclass(frozen=True)
class Taken(Node):
    """Entry ``i`` along ``axis`` of ``node`` (that axis removed)."""

    node: Node
    axis: int
    i: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.node.shape
        return shape[: self.axis] + shape[self.axis + 1 :]

    def pieces(self, box: Box) -> tuple[list[Piece], Assemble]:
        inner = box[: self.axis] + ((self.i, self.i + 1),) + box[self.axis :]
        sub, assemble = self.node.pieces(inner)
        return sub, lambda arrays: np.squeeze(assemble(arrays), axis=self.axis)


@dataclasses.dataclass(frozen=True)
class Fused(Node):
    """``parts`` concatenated along ``axis`` (their other axes equal)."""

    parts: tuple[Node, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.parts[0].shape)
        shape[self.axis] = sum(p.shape[self.axis] for p in self.parts)
        return tuple(shape)

    def pieces(self, box: Box) -> tuple[list[Piece], Assemble]:
        lo, hi = box[self.axis]
        plans = []
        off = 0
        for part in self.parts:
            n = part.shape[self.axis]
            start, stop = max(lo, off), min(hi, off + n)
            if start < stop:
                sub = box[: self.axis] + ((start - off, stop - off),) + box[self.axis + 1 :]
                plans.append(part.pieces(sub))
            off += n
        if not plans:
            return _nothing(box, self.dtype)
        return _join(plans, lambda arrays: np.concatenate(arrays, axis=self.axis))


@dataclasses.dataclass(frozen=True)
class Sliced(Node):
    """``node[start:start + size]`` along ``axis`` (one part of a split)."""

    node: Node
    axis: int
    start: int
    size: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.node.shape)
        shape[self.axis] = self.size
        return tuple(shape)

    def pieces(self, box: Box) -> tuple[list[Piece], Assemble]:
        lo, hi = box[self.axis]
        inner = box[: self.axis] + ((lo + self.start, hi + self.start),) + box[self.axis + 1 :]
        return self.node.pieces(inner)


@dataclasses.dataclass(frozen=True)
class Transposed(Node):
    """``np.transpose(node, axes)``: axis ``d`` of the result is ``axes[d]`` of ``node``."""

    node: Node
    axes: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.node.shape[a] for a in self.axes)

    def pieces(self, box: Box) -> tuple[list[Piece], Assemble]:
        inner: list[tuple[int, int]] = [(0, 0)] * len(self.axes)
        for d, a in enumerate(self.axes):
            inner[a] = box[d]
        sub, assemble = self.node.pieces(tuple(inner))
        return sub, lambda arrays: np.transpose(assemble(arrays), self.axes)


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """One leaf of like: ``path``, its ``shape`` and ``dtype`` (as saved, before any
    cast), and ``sources``: ``(saved path, ((lo, hi), ...))`` for each saved region it
    is made of, in order; ``how``: what surgery made it (``"as saved"`` otherwise)."""

    path: str
    shape: tuple[int, ...]
    dtype: str | None
    sources: tuple[tuple[str, Box], ...]
    how: str = "as saved"


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """What a restore would read (``dry_run=True``): one :class:`PlanEntry` per leaf of
    like it reads, in like's order; ``kept``: like's paths kept as like's own value
    (``missing="keep"``); ``dropped``: saved paths not read. Printing it lists them."""

    where: str
    entries: tuple[PlanEntry, ...]
    kept: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()

    def entry(self, path: str) -> PlanEntry:
        for e in self.entries:
            if e.path == path:
                return e
        raise KeyError(path)

    def __str__(self) -> str:
        lines = [f"restore plan for {self.where}: {len(self.entries)} leaves read"]
        for e in self.entries:
            lines.append(f"  {e.path} {e.dtype}{list(e.shape)} <- {e.how}:")
            for path, box in e.sources:
                ranges = ", ".join(f"{lo}:{hi}" for lo, hi in box)
                lines.append(f"      {path}[{ranges}]")
        lines.extend(f"  {p} <- kept from like" for p in self.kept)
        lines.extend(f"  (saved {p} not read)" for p in self.dropped)
        return "\n".join(lines)


class _Tree:
    """The leaves as the operations so far left them, and the problems found."""

    def __init__(self, nodes: dict[str, Node], others: dict[str, Any]):
        self.nodes, self.others = nodes, others
        self.how: dict[str, str] = {}
        self.problems: list[str] = []

    def take(self, op: Any, path: str) -> Node | None:
        node = self.nodes.pop(path, None)
        if node is None:
            found = "a leaf that is no array" if path in self.others else "no such leaf"
            self.problems.append(
                f"leaf {path!r}: expected by surgery {op!r} (an array saved, after "
                f"transform= and the operations before it), found {found}"
            )
        return node

    def put(self, op: Any, path: str, node: Node, was: str | None = None) -> None:
        """``node`` at ``path``, made by ``op`` (from the leaf that was at ``was``)."""
        if path in self.nodes or path in self.others:
            self.problems.append(
                f"leaf {path!r}: made by surgery {op!r}, found a leaf of that path already"
            )
            return
        self.nodes[path] = node
        before = self.how.pop(was, None) if was is not None else None
        self.how[path] = repr(op) if before is None else f"{before}, then {op!r}"

    def under(self, op: Any, path: str) -> list[str]:
        """``[path]``, or the leaves under it when it is a prefix (none: a problem)."""
        if not path.endswith("/"):
            return [path]
        if not (found := [p for p in self.nodes if p.startswith(path)]):
            self.problems.append(f"surgery {op!r}: expected leaves under {path!r}, found none")
        return found


def _axis(tree: _Tree, op: Any, path: str, ndim: int, axis: int) -> int | None:
    if -ndim <= axis < ndim:
        return axis % ndim
    tree.problems.append(
        f"leaf {path!r}: surgery {op!r} expects an axis in [{-ndim}, {ndim}), found {ndim} axes"
    )
    return None


def _same(tree: _Tree, op: Any, paths: list[str], nodes: list[Node], skip: int | None):
    """Whether ``nodes`` agree in dtype and shape (but axis ``skip``); each other is a problem."""
    first, ok = nodes[0], True

    def cut(shape):
        return tuple(n for d, n in enumerate(shape) if d != skip)

    for path, node in zip(paths[1:], nodes[1:], strict=True):
        if (
            node.dtype != first.dtype
            or cut(node.shape) != cut(first.shape)
            or (skip is not None and len(node.shape) != len(first.shape))
        ):
            tree.problems.append(
                f"leaf {path!r}: surgery {op!r} expects {first.dtype}{list(first.shape)} "
                f"(as {paths[0]!r}{'' if skip is None else f', but axis {skip}'}), "
                f"found {node.dtype}{list(node.shape)}"
            )
            ok = False
    return ok


def _layers(pattern: str, paths: list[str]) -> dict[str, dict[int, str]]:
    """``{rest of path: {i: path}}`` for the paths ``pattern`` (with ``{i}``) matches."""
    head, tail = pattern.split("{i}", 1)
    rest = "(.*)" if pattern.endswith("/") else "()"  # a prefix: every leaf under it
    regex = re.escape(head) + _NUMBER + re.escape(tail) + rest
    out: dict[str, dict[int, str]] = {}
    for path in paths:
        if m := re.fullmatch(regex, path):
            out.setdefault(m.group(2), {})[int(m.group(1))] = path
    return out


def _stack(tree: _Tree, op: Stack) -> None:
    if isinstance(op.sources, tuple):
        groups = {"": dict(enumerate(op.sources))}
    else:
        groups = _layers(op.sources, list(tree.nodes))
        if not groups:
            tree.problems.append(f"surgery {op!r}: expected leaves {op.sources!r}, found none")
    for rest, by_i in sorted(groups.items()):
        n = len(by_i)
        present = sorted(by_i)
        if present[-1] != n - 1:  # distinct from 0: all there exactly when the last is n-1
            absent = _shown.number_ranges(_shown.gaps(present))  # never range(max) itself
            tree.problems.append(
                f"leaf {op.target + rest!r}: surgery {op!r} expects layers 0..{present[-1]}, "
                f"found no layer [{absent}]"
            )
            continue
        paths = [by_i[i] for i in range(n)]
        nodes = [tree.take(op, p) for p in paths]
        if any(x is None for x in nodes) or not _same(tree, op, paths, nodes, None):
            continue
        axis = _axis(tree, op, paths[0], len(nodes[0].shape) + 1, op.axis)
        if axis is not None:
            tree.put(op, op.target + rest, Stacked(tuple(nodes), axis))


def _unstack(tree: _Tree, op: Unstack) -> None:
    for path in tree.under(op, op.source):
        node = tree.take(op, path)
        if node is None:
            continue
        axis = _axis(tree, op, path, len(node.shape), op.axis)
        if axis is None:
            continue
        rest = path[len(op.source) :]
        for i in range(node.shape[axis]):
            tree.put(op, op.targets.replace("{i}", str(i)) + rest, Taken(node, axis, i))


def _fuse(tree: _Tree, op: Fuse) -> None:
    nodes = [tree.take(op, p) for p in op.sources]
    if any(x is None for x in nodes):
        return
    axis = _axis(tree, op, op.sources[0], len(nodes[0].shape), op.axis)
    if axis is not None and _same(tree, op, list(op.sources), nodes, axis):
        tree.put(op, op.target, Fused(tuple(nodes), axis))


def _split(tree: _Tree, op: Split) -> None:
    node = tree.take(op, op.source)
    if node is None:
        return
    axis = _axis(tree, op, op.source, len(node.shape), op.axis)
    if axis is None:
        return
    n, k = node.shape[axis], len(op.targets)
    sizes = op.sizes or ((n // k,) * k if n % k == 0 else None)
    if sizes is None or sum(sizes) != n:
        tree.problems.append(
            f"leaf {op.source!r}: surgery {op!r} expects axis {axis} of "
            f"{sum(sizes) if sizes else f'a multiple of {k}'}, found {list(node.shape)}"
        )
        return
    start = 0
    for target, size in zip(op.targets, sizes, strict=True):
        tree.put(op, target, Sliced(node, axis, start, size))
        start += size


def _transpose(tree: _Tree, op: Transpose) -> None:
    node = tree.take(op, op.path)
    if node is None:
        return
    if len(op.axes) != len(node.shape):
        tree.problems.append(
            f"leaf {op.path!r}: surgery {op!r} expects {len(op.axes)} axes, found "
            f"{node.dtype}{list(node.shape)}"
        )
        return
    tree.put(op, op.path, Transposed(node, op.axes), was=op.path)


def _rename(tree: _Tree, op: Rename) -> None:
    for old in tree.under(op, op.old):
        node = tree.take(op, old)
        if node is not None:
            tree.put(op, op.new + old[len(op.old) :], node, was=old)


_APPLY = {Stack: _stack, Unstack: _unstack, Fuse: _fuse, Split: _split}
_APPLY.update({Transpose: _transpose, Rename: _rename})


@dataclasses.dataclass(frozen=True)
class Made:
    """A leaf surgery made: its record as like sees it (shape, dtype), its node, how."""

    record: LeafRecord
    node: Node
    how: str


def apply(
    records: dict[str, tuple[int, Any]], ops: tuple[Any, ...]
) -> tuple[dict[str, tuple[int, Any]], dict[str, Made], list[str]]:
    """``records`` as ``ops`` leave them, the leaves they made (stand-in records, read
    through the node) and the problems found (empty: all fit)."""
    if not ops:
        return records, {}, []
    nodes: dict[str, Node] = {}
    others: dict[str, Any] = {}
    for path, (index, record) in records.items():
        if record.kind == "array" and index >= 0:
            nodes[path] = Saved(index, record)
        else:
            others[path] = (index, record)
    tree = _Tree(nodes, others)
    for op in ops:
        _APPLY[type(op)](tree, op)
    out = dict(others)
    made: dict[str, Made] = {}
    for path, node in tree.nodes.items():
        if isinstance(node, Saved):
            out[path] = (node.index, node.record)
            continue
        pieces, _ = node.pieces(full_box(node.shape))
        index = pieces[0].index if pieces else 0
        record = LeafRecord(path, (), "array", tuple(node.shape), node.dtype)
        out[path] = (index, record)
        made[path] = Made(record, node, tree.how.get(path, "surgery"))
    return out, made, tree.problems
