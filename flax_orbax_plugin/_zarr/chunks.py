"""One zarr3 chunk on disk (name, bytes, crc32c trailer, its grid), whether a leaf is stored
packed, and format version 2's data index.

Pure functions and immutable records: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.chunks``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from .._format.layout import ArrayStorage, LeafRecord

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the fallback: holds the GIL on numpy buffers
    import google_crc32c

    def _crc32c(data, value: int = 0) -> int:
        return google_crc32c.extend(value, data)

    GIL_FREE_CRC = False  # read by benchmarks/bench_onepass.py
else:
    GIL_FREE_CRC = True

THREADS = 8  # as tensorstore's file_io_concurrency for local disks (_storage.context)
CHUNK_DIR = "c"  # zarr3 default chunk key encoding: c/<i0>/<i1>/...
CRC_BYTES = 4  # the crc32c codec's trailer, little endian
CRC32C_RESIDUE = 0x48674BC7  # crc32c of any message followed by its own crc32c (LE)
MISSING_ENTRY = (1 << 64) - 1  # a shard index entry for an inner chunk that is not stored
IOV_MAX = 1000  # below the kernel's 1024 buffers per writev


def chunk_parts(cell) -> tuple[str, ...]:
    """The path parts of chunk grid cell ``cell`` under its array's directory."""
    return (CHUNK_DIR, *map(str, cell))


def chunk_key(cell) -> str:
    """``c/<i0>/<i1>/...``: the key of chunk grid cell ``cell`` under its array."""
    return "/".join(chunk_parts(cell))


def whole_chunks(shape, chunk, index):
    """For the global region ``index`` of an array of ``shape``: (the region's shape,
    [(chunk grid cell, its part of the region, relative), ...]); None when the region is
    empty or not whole chunks (one cut by the array's end counts as whole)."""
    if not shape:
        return None
    starts, stops = [], []
    for s, n, c in zip(index, shape, chunk, strict=True):
        start, stop, step = s.indices(n)
        if step != 1 or start >= stop or start % c or (stop % c and stop != n):
            return None
        starts.append(start)
        stops.append(stop)
    cells = []
    ranges = [range(a // c, -(-b // c)) for a, b, c in zip(starts, stops, chunk, strict=True)]
    for cell in itertools.product(*ranges):
        at = []
        for i, c, n, start in zip(cell, chunk, shape, starts, strict=True):
            at.append(slice(i * c - start, min(i * c + c, n) - start))
        cells.append((cell, tuple(at)))
    return tuple(b - a for a, b in zip(starts, stops, strict=True)), cells


def crc_trailer(parts: list[np.ndarray]) -> np.ndarray:
    """The zarr3 ``crc32c`` trailer of the bytes of ``parts`` in order, as 4 uint8."""
    crc = 0
    for part in parts:
        crc = _crc32c(as_bytes(part), crc)
    return np.frombuffer(crc.to_bytes(CRC_BYTES, "little"), np.uint8)


def chunk_payload(view: np.ndarray, chunk: tuple[int, ...]) -> np.ndarray:
    """The stored bytes of one chunk (before its crc32c) from ``view``, its part of the
    array, zero-padded to the full ``chunk`` where the array's end cuts it."""
    if view.shape != chunk:
        full = np.zeros(chunk, view.dtype)
        full[tuple(slice(0, n) for n in view.shape)] = view
        view = full
    elif not view.flags.c_contiguous:
        view = np.ascontiguousarray(view)
    return as_bytes(view)


def as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat, read-only uint8 view (read-only:
    what google_crc32c takes)."""
    out = array.reshape(-1).view(np.uint8)
    out.flags.writeable = False
    return out


def advance(views: list[memoryview], done: int) -> None:
    """Drops ``done`` bytes from the front of ``views`` (after a short read or write)."""
    while done:
        if done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][done:]
            done = 0


def is_packed(record: LeafRecord) -> bool:
    return isinstance(record.storage, ArrayStorage) and record.storage.packed


INDEX_FORMAT = "flax_orbax_plugin/data"
DATA_DIR = "data"
MAX_SEGMENT_BYTES = 1 << 50


def index_name(process: int) -> str:
    """The index file of ``process`` inside the item (``data/<process>.json``)."""
    return f"{DATA_DIR}/{int(process)}.json"


def data_file_name(process: int, number: int) -> str:
    """The name of data file ``number`` of ``process`` inside ``data/``."""
    return f"{int(process)}-{int(number)}.bin"


def array_prefix(key: str) -> str:
    """``d/<i>`` or ``b/<batch>``: the array a chunk key belongs to."""
    return key[: key.index("/c/")]


@dataclasses.dataclass(frozen=True)
class Segment:
    """One chunk inside a data file: ``file`` (its name inside ``data/``), the byte
    ``offset`` and ``length`` there, and the crc32c its last four bytes hold."""

    file: str
    offset: int
    length: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class DataIndex:
    """The index of one process: its data files (name -> bytes), chunks, and the stored
    dtype of every array it holds chunks of (empty in an index older than that)."""

    process: int
    files: dict[str, int]
    chunks: dict[str, Segment]
    arrays: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        names = list(self.files)
        number = {name: n for n, name in enumerate(names)}
        return {
            "format": INDEX_FORMAT,
            "format_version": 2,
            "process": self.process,
            "files": [{"name": name, "bytes": self.files[name]} for name in names],
            "chunks": {
                key: [number[s.file], s.offset, s.length, s.crc32c]
                for key, s in sorted(self.chunks.items())
            },
            "arrays": dict(sorted(self.arrays.items())),
        }
