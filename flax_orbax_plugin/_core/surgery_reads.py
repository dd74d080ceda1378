"""Reading the leaves layout surgery made, from the boxes of the saved leaves they cover.
Threading: the restoring thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._format.layout import ArrayStorage
from .._like.surgery_plan import Piece
from .._zarr import subbyte as _subbyte
from .reads import Target, make_target, read_slice


def _box(region: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A region (slices, None: all) as ``((lo, hi), ...)``."""
    if region is None:
        return tuple((0, n) for n in shape)
    out = []
    for s, n in zip(region, shape, strict=True):
        lo, hi, _ = s.indices(n) if isinstance(s, slice) else (s, s + 1, 1)
        out.append((lo, hi))
    return tuple(out)


class VirtualRead:
    """The read of ``region`` of a made leaf: pieces read now, assembled on :meth:`result`."""

    def __init__(self, made: Any, region: Any, saved: SavedReads):
        pieces, self.assemble = made.node.pieces(_box(region, made.node.shape))
        self.reads = [saved.read(p) for p in pieces]

    def result(self) -> np.ndarray:
        return self.assemble([r.result() for r in self.reads])


class _Cut:
    """A small leaf out of one read of its batch from ``start``, cut to ``box``."""

    def __init__(self, read, start: int, record, box):
        self.read, self.start, self.record, self.box = read, start, record, box

    def result(self) -> np.ndarray:
        off, size = self.record.storage.offset - self.start, self.record.storage.size
        data = self.read.result()[off : off + size]
        if self.record.storage.packed:  # a sub-byte leaf's packed bytes
            data = _subbyte.unpack_flat(data, self.record)
        data = data.reshape(self.record.shape)
        return data[tuple(slice(lo, hi) for lo, hi in self.box)]


class SavedReads:
    """Region reads of saved leaves; a store opened once, a batch's span read once."""

    def __init__(self, location, doc, fmt, direct, read_region, targets: list[Target]):
        self.location, self.doc, self.fmt, self.direct = location, doc, fmt, direct
        self.read_region = read_region
        self.stores: dict[Any, Any] = {}
        self.spans: dict[str, tuple[int, int]] = {}
        for t in sources(targets):
            storage = t.record.storage
            if isinstance(storage, ArrayStorage):
                continue
            lo, hi = self.spans.get(storage.batch, (storage.offset, storage.offset))
            end = storage.offset + storage.size
            self.spans[storage.batch] = (min(lo, storage.offset), max(hi, end))

    def read(self, piece: Piece):
        record = piece.record
        target = make_target(piece.index, record, None, cast="safe")
        if isinstance(record.storage, ArrayStorage):
            key = ("leaf", piece.index)
            if key not in self.stores:
                self.stores[key] = self.fmt.array_store(self.location, target, [record.path])
            region = tuple(slice(lo, hi) for lo, hi in piece.box)
            return self.read_region(self.fmt, self.stores[key], target, self.direct, region)
        batch = self.doc.batches[record.storage.batch]
        key = ("batch", batch.name)
        if key not in self.stores:
            self.stores[key] = self.fmt.batch_store(
                self.location, batch, self.direct, [record.path]
            )
        lo, hi = self.spans[batch.name]
        if ("span", batch.name) not in self.stores:
            read = read_slice(self.stores[key], self.direct, batch, lo, hi - lo)
            self.stores["span", batch.name] = _Once(read)
        return _Cut(self.stores["span", batch.name], lo, record, piece.box)


class _Once:
    """A read waited for once, its array kept for every leaf cut from it."""

    def __init__(self, read):
        self.read, self.out = read, None

    def result(self) -> np.ndarray:
        if self.out is None:
            self.out = self.read.result()
        return self.out


def on_chunks(made: Any, boxes: list[tuple[tuple[int, int], ...]]) -> bool:
    """Whether every saved region ``boxes`` need falls on whole chunks (each box read alone)."""
    for box in boxes:
        pieces, _ = made.node.pieces(box)
        for p in pieces:
            storage = p.record.storage
            if not isinstance(storage, ArrayStorage):
                continue  # a small leaf: its batch span is read once whatever the boxes
            for (lo, hi), c, n in zip(p.box, storage.chunk_shape, p.record.shape, strict=True):
                if lo % c or (hi % c and hi != n):
                    return False
    return True


def sources(targets: list[Target]) -> list[Target]:
    """The saved leaves the made leaves among ``targets`` read (for the claims check)."""
    out: dict[int, Target] = {}
    for t in targets:
        if t.virtual is None:
            continue
        node = t.virtual.node
        pieces, _ = node.pieces(tuple((0, n) for n in node.shape))
        for p in pieces:
            out.setdefault(p.index, make_target(p.index, p.record, None, cast="safe"))
    return list(out.values())
