"""What a leaf is made of after layout surgery, and the plan a ``dry_run`` returns.

A node has a shape and a dtype and answers :meth:`Node.pieces`: for a box of itself
(``((lo, hi), ...)``), the saved leaves' boxes to read and the function assembling
their arrays into the box's. Nodes compose, so every target shard reads exactly the
saved regions it covers. Pure numpy, no reads. Threading: immutable; any thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Piece", "PlanEntry", "RestorePlan"]

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
