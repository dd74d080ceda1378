"""A reused leaf's chunk files: their names, their size, and the crc32c the snapshot's
bytes give each (what a linked or copied chunk must carry in its trailer).

Shared by :mod:`.links` and :mod:`.copies`; pure functions of a leaf's record and this
process's snapshot of it. A chunk that fails a check is :class:`Refused`: the leaf is
then written instead. Design: ``docs/incremental.md``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import numpy as np

from .._format.layout import LeafRecord, dtype_from_name
from .._zarr import chunks as _chunks
from .._zarr import crcs as _crcs

CRC_BYTES = _chunks.CRC_BYTES
Writes = list[tuple[tuple[slice, ...], np.ndarray]]  # a leaf's (region, data) to write


class Refused(Exception):
    """One linked file fails a check: the leaf is written instead."""


def chunk_names(record: LeafRecord) -> list[tuple[str, ...]]:
    """Every chunk file of an array leaf, as path parts under ``d/<i>/`` (zarr3 default
    chunk key encoding: ``c/<i0>/<i1>/...``)."""
    chunk = record.storage.chunk_shape
    grid = [max(1, -(-s // c)) for s, c in zip(record.shape, chunk, strict=True)]
    return [_chunks.chunk_parts(idx) for idx in itertools.product(*(range(g) for g in grid))]


def chunk_file_bytes(record: LeafRecord) -> int:
    """Size of each stored chunk file (a full chunk, edge chunks padded, plus crc32c):
    every dtype, sub-byte ones too, stores ``itemsize`` bytes per element."""
    itemsize = dtype_from_name(record.dtype).itemsize
    return math.prod(record.storage.chunk_shape) * itemsize + CRC_BYTES


def not_the_snapshot(shown: str, stored: int, expected: int) -> str:
    return (
        f"{shown}: its crc32c {stored:08x} is not that of the snapshot's bytes for this "
        f"chunk ({expected:08x}): it holds other bytes than its leaf's recorded digest says"
    )


def snapshot_crcs(
    record: LeafRecord, writes: Writes, names: Iterable[tuple[str, ...]]
) -> dict[tuple[str, ...], int]:
    """``{chunk name: crc32c}`` for ``names`` (as :func:`chunk_names`): the crc32c trailer
    each chunk file would get if written from ``writes`` (``_zarr.crcs.chunk_crcs``:
    the stored encoding, edge chunks zero-padded). Raises :class:`Refused` for a name
    that no region of ``writes`` covers whole (nothing to compare it with)."""
    shape, chunk = tuple(record.shape), tuple(record.storage.chunk_shape)
    wanted = set(names)
    out: dict[tuple[str, ...], int] = {}
    for region, data in writes:
        if not data.size:
            continue
        try:
            crcs = _crcs.chunk_crcs(shape, chunk, region, data)
        except (ValueError, TypeError) as e:  # a region this function cannot encode
            raise Refused(f"the snapshot's crc32c per chunk: {type(e).__name__}: {e}") from e
        for cell, crc in (crcs or {}).items():
            if _chunks.chunk_parts(cell) in wanted:
                out[_chunks.chunk_parts(cell)] = crc
    missing = sorted(wanted - set(out))
    if missing:
        raise Refused(
            f"chunk {'/'.join(missing[0])}: not whole in this process's snapshot of the leaf"
            " (nothing to compare the previous chunk with)"
        )
    return out
