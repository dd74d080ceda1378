"""A reused leaf's chunk files: names, size, and the crc32c the snapshot's bytes give
each. Pure functions; a chunk failing a check is :class:`Refused` (the leaf is written)."""

from __future__ import annotations

import itertools
import math
import os
import stat
from collections.abc import Iterable

import numpy as np

from .._format.layout import LeafRecord, dtype_from_name
from .._zarr import chunks as _chunks

CRC_BYTES = _chunks.CRC_BYTES
_READ_BLOCK = 8 << 20  # a linked file is read in blocks: a chunk may be large
Writes = list[tuple[tuple[slice, ...], np.ndarray]]  # a leaf's (region, data) to write


class Refused(Exception):
    """One linked file fails a check: the leaf is written instead."""


def chunk_names(record: LeafRecord) -> list[tuple[str, ...]]:
    """Every chunk file of an array leaf, as path parts under ``d/<i>/``."""
    chunk = record.storage.chunk_shape
    grid = [max(1, -(-s // c)) for s, c in zip(record.shape, chunk, strict=True)]
    return [_chunks.chunk_parts(idx) for idx in itertools.product(*(range(g) for g in grid))]


def chunk_file_bytes(record: LeafRecord) -> int:
    """Size of each stored chunk file (a full chunk, padded, plus crc32c)."""
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
    """``{chunk name: crc32c}``: the trailer each chunk of ``names`` would get if written
    from ``writes``; :class:`Refused` for one no region covers whole."""
    shape, chunk = tuple(record.shape), tuple(record.storage.chunk_shape)
    wanted = set(names)
    out: dict[tuple[str, ...], int] = {}
    for region, data in writes:
        if not data.size:
            continue
        try:
            crcs = _chunks.chunk_crcs(shape, chunk, region, data)
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


def check_linked(dfd: int, name: str, shown: str, size: int, segments: list, differs) -> None:
    """Checks the file just linked as ``name`` in ``dfd`` (``shown``: its source; its inode
    can no longer be swapped under our name): a regular file of ``size`` bytes in which
    each ``(where, offset, length, crc)`` segment's trailer matches its bytes and equals
    ``crc`` (else :class:`Refused`, ``differs(where, stored, crc)`` its words)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise Refused(f"{shown}: expected a regular file of {size} bytes, found {st.st_size}")
        for where, offset, length, expected in segments:
            crc, at, stop = 0, offset, offset + length
            while at < stop:
                block = os.pread(fd, min(_READ_BLOCK, stop - at), at)
                if not block:
                    break
                crc = _chunks.extend_crc(crc, block)
                at += len(block)
            if at != stop or crc != _chunks.CRC32C_RESIDUE:
                raise Refused(f"{where}: its crc32c does not match its bytes (damaged or changed)")
            stored = int.from_bytes(os.pread(fd, CRC_BYTES, stop - CRC_BYTES), "little")
            if stored != expected:
                raise Refused(differs(where, stored, expected))
    finally:
        os.close(fd)
