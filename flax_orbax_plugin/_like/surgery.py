"""Layout surgery on restore (``surgery=[...]``): stack, unstack, fuse, split, transpose
and rename, declared on the saved records, not run on data.

``check_surgery`` where the option enters; ``apply`` after ``transform=``. Pure; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.surgery``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .._base import shown as _shown
from .._errors import TransformError
from .._format.layout import LeafRecord
from . import surgery_plan as _plan
from .surgery_ops import OPS, Fuse, Rename, Split, Stack, Transpose, Unstack

__all__ = ["Stack", "Unstack", "Fuse", "Split", "Transpose", "Rename"]

_NUMBER = "(0|[1-9][0-9]*)"


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


class _Tree:
    """The leaves as the operations so far left them, and the problems found."""

    def __init__(self, nodes: dict[str, _plan.Node], others: dict[str, Any]):
        self.nodes, self.others = nodes, others
        self.how: dict[str, str] = {}
        self.problems: list[str] = []

    def take(self, op: Any, path: str) -> _plan.Node | None:
        node = self.nodes.pop(path, None)
        if node is None:
            found = "a leaf that is no array" if path in self.others else "no such leaf"
            self.problems.append(
                f"leaf {path!r}: expected by surgery {op!r} (an array saved, after "
                f"transform= and the operations before it), found {found}"
            )
        return node

    def put(self, op: Any, path: str, node: _plan.Node, was: str | None = None) -> None:
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


def _same(tree: _Tree, op: Any, paths: list[str], nodes: list[_plan.Node], skip: int | None):
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
        m = re.fullmatch(regex, path)
        if m:
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
            tree.put(op, op.target + rest, _plan.Stacked(tuple(nodes), axis))


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
            tree.put(op, op.targets.replace("{i}", str(i)) + rest, _plan.Taken(node, axis, i))


def _fuse(tree: _Tree, op: Fuse) -> None:
    nodes = [tree.take(op, p) for p in op.sources]
    if any(x is None for x in nodes):
        return
    axis = _axis(tree, op, op.sources[0], len(nodes[0].shape), op.axis)
    if axis is not None and _same(tree, op, list(op.sources), nodes, axis):
        tree.put(op, op.target, _plan.Fused(tuple(nodes), axis))


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
        tree.put(op, target, _plan.Sliced(node, axis, start, size))
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
    tree.put(op, op.path, _plan.Transposed(node, op.axes), was=op.path)


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
    node: _plan.Node
    how: str


def apply(
    records: dict[str, tuple[int, Any]], ops: tuple[Any, ...]
) -> tuple[dict[str, tuple[int, Any]], dict[str, Made], list[str]]:
    """``records`` as ``ops`` leave them, the leaves they made (stand-in records, read
    through the node) and the problems found (empty: all fit)."""
    if not ops:
        return records, {}, []
    nodes: dict[str, _plan.Node] = {}
    others: dict[str, Any] = {}
    for path, (index, record) in records.items():
        if record.kind == "array" and index >= 0:
            nodes[path] = _plan.Saved(index, record)
        else:
            others[path] = (index, record)
    tree = _Tree(nodes, others)
    for op in ops:
        _APPLY[type(op)](tree, op)
    out = dict(others)
    made: dict[str, Made] = {}
    for path, node in tree.nodes.items():
        if isinstance(node, _plan.Saved):
            out[path] = (node.index, node.record)
            continue
        pieces, _ = node.pieces(_plan.full_box(node.shape))
        index = pieces[0].index if pieces else 0
        record = LeafRecord(path, (), "array", tuple(node.shape), node.dtype)
        out[path] = (index, record)
        made[path] = Made(record, node, tree.how.get(path, "surgery"))
    return out, made, tree.problems
