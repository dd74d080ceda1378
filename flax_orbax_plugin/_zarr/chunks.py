"""One zarr3 chunk on disk (name, bytes, crc32c trailer, its grid), regions of whole
chunks within a budget, the crc32c of a region's chunks, and format version 2's data
index. Pure functions and immutable records: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.chunks``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
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
    """(region shape, [(chunk grid cell, its part of the region), ...]) of the global
    region ``index``; None when it is empty or not whole chunks."""
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


def covering(shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int, budget: int):
    """Regions of whole chunks covering an array, each at most ``budget`` bytes if it can."""
    if not shape or math.prod(shape) * itemsize <= budget:
        yield None
        return
    ndim = len(shape)
    axis = ndim - 1
    for k in range(ndim):  # the first axis along which a run of whole chunks fits
        if math.prod(chunk[: k + 1]) * math.prod(shape[k + 1 :]) * itemsize <= budget:
            axis = k
            break
    per_chunk = math.prod(chunk[: axis + 1]) * math.prod(shape[axis + 1 :]) * itemsize
    step = chunk[axis] * max(1, budget // per_chunk)
    outer = (range(0, shape[a], chunk[a]) for a in range(axis))
    for starts in itertools.product(*outer):
        cells = zip(starts, chunk[:axis], shape[:axis], strict=True)
        head = tuple(slice(a, min(a + c, n)) for a, c, n in cells)
        tail = tuple(slice(0, n) for n in shape[axis + 1 :])
        for lo in range(0, shape[axis], step):
            yield (*head, slice(lo, min(lo + step, shape[axis])), *tail)


def within(shape: tuple[int, ...], span, chunk, itemsize: int, budget: int):
    """covering regions of the part ``span`` (a tuple of slices; None: all) of an array."""
    if span is None:
        yield from covering(shape, chunk, itemsize, budget)
        return
    extents = tuple(s.stop - s.start for s in span)
    for region in covering(extents, chunk, itemsize, budget):
        if region is None:
            yield span
        else:
            pairs = zip(span, region, strict=True)
            yield tuple(slice(s.start + r.start, s.start + r.stop) for s, r in pairs)


def nbytes(region, shape: tuple[int, ...], itemsize: int) -> int:
    if region is None:
        return math.prod(shape) * itemsize
    return math.prod(s.stop - s.start for s in region) * itemsize


def crc_trailer(parts: list[np.ndarray]) -> np.ndarray:
    """The zarr3 ``crc32c`` trailer of the bytes of ``parts`` in order, as 4 uint8."""
    crc = 0
    for part in parts:
        crc = _crc32c(as_bytes(part), crc)
    return np.frombuffer(crc.to_bytes(CRC_BYTES, "little"), np.uint8)


def chunk_payload(view: np.ndarray, chunk: tuple[int, ...]) -> np.ndarray:
    """The stored bytes of one chunk (before its crc32c) from ``view``, zero-padded."""
    if view.shape != chunk:
        full = np.zeros(chunk, view.dtype)
        full[tuple(slice(0, n) for n in view.shape)] = view
        view = full
    elif not view.flags.c_contiguous:
        view = np.ascontiguousarray(view)
    return as_bytes(view)


def as_bytes(array: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat read-only uint8 view (google_crc32c's)."""
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


try:  # the optional C extension (setup.py): copies and checksums in one pass
    from . import _copycrc
except ImportError:  # not built (no compiler): np.copyto, then the crc32c of ``chunks``
    _copycrc = None


def extend_crc(crc: int, data) -> int:
    """crc32c of the bytes so far (``crc``) followed by ``data`` (any C-contiguous buffer)."""
    return _crc32c(data, crc)


def chunk_crcs(
    shape: tuple[int, ...], chunk: tuple[int, ...], index: tuple[slice, ...], data: np.ndarray
) -> dict[tuple[int, ...], int] | None:
    """``{chunk grid cell: crc32c}``: the trailer each chunk of the global region ``index``
    holding ``data`` stores; None when it is not whole chunks."""
    if data.dtype.byteorder == ">":  # the stored encoding is little endian
        data = data.astype(data.dtype.newbyteorder("<"))
    if not shape:
        if data.shape != ():
            return None
        return {(): _crc32c(as_bytes(np.ascontiguousarray(data)))}
    region = whole_chunks(shape, chunk, index)
    if region is None or data.shape != region[0]:
        return None
    return {cell: _crc32c(chunk_payload(data[at], tuple(chunk))) for cell, at in region[1]}


COPY_STEP = 256 << 10  # without the kernel: bytes copied, then checksummed, at a time


def has_kernel() -> bool:
    """Whether the C kernel of :func:`copy_crc` is built (and imported) here."""
    return _copycrc is not None


def copy_crc(dst: np.ndarray, src: np.ndarray, crc: int = 0, kernel: bool | None = None) -> int:
    """``dst[...] = src`` for flat uint8 arrays of one size; returns the crc32c of those
    bytes continued from ``crc``. ``kernel``: None, the C kernel where built; True, the
    kernel (RuntimeError where not built); False, ``np.copyto`` then the crc32c,
    :data:`COPY_STEP` bytes at a time (each piece checksummed while still in cache)."""
    if kernel is None:
        kernel = _copycrc is not None
    if kernel:
        if _copycrc is None:
            raise RuntimeError(
                "copy_crc: the C kernel (flax_orbax_plugin._zarr._copycrc) is not built"
            )
        return _copycrc.copy_crc(dst, src, crc)
    for a in range(0, dst.size, COPY_STEP):
        np.copyto(dst[a : a + COPY_STEP], src[a : a + COPY_STEP])
        crc = _crc32c(dst[a : a + COPY_STEP], crc)
    return crc


def extend_zeros(crc: int, n: int) -> int:
    """crc32c of the bytes so far (``crc``) followed by ``n`` zero bytes."""
    if _copycrc is not None:
        return _copycrc.extend_zeros(crc, n)
    return _crc32c(np.zeros(n, np.uint8), crc) if n else crc


def copy_with_crcs(
    dst: np.ndarray,
    src: np.ndarray,
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    index: tuple[slice, ...],
    out: dict,
    kernel: bool | None = None,
) -> None:
    """``np.copyto(dst, src)`` for the region ``index`` (global) of an array of ``shape``,
    putting each chunk's crc32c (as :func:`chunk_crcs`) in ``out`` where it is whole
    chunks: a chunk of whole rows in one pass (:func:`copy_crc`, ``kernel``: which way),
    others copied then checksummed. Nothing for a 0-d or big-endian array."""
    region = None if dst.dtype.byteorder == ">" else whole_chunks(shape, chunk, index)
    if region is None or dst.shape != region[0] or src.shape != dst.shape:
        np.copyto(dst, src)
        return
    for cell, at in region[1]:
        d, s = dst[at], src[at]
        if d.shape[1:] == tuple(chunk[1:]) and d.flags.c_contiguous and s.flags.c_contiguous:
            flat_d, flat_s = d.reshape(-1).view(np.uint8), s.reshape(-1).view(np.uint8)
            crc = copy_crc(flat_d, flat_s, 0, kernel)
            pad = (int(np.prod(chunk)) - d.size) * d.dtype.itemsize  # cut by the array's end
            crc = extend_zeros(crc, pad)
        else:
            np.copyto(d, s)
            crc = _crc32c(chunk_payload(d, tuple(chunk)))
        out[cell] = crc


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
    """One chunk inside a data file (``data/<file>``) and the crc32c its last bytes hold."""

    file: str
    offset: int
    length: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class DataIndex:
    """One process's index: data files (name -> bytes), chunks, each array's stored dtype."""

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
