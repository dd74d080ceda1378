"""One zarr3 chunk on disk: its name, its stored bytes and its crc32c trailer.

The only place that knows the chunk key encoding (``c/<i0>/<i1>/...`` under an
array's directory), the ``crc32c`` codec's 4-byte little-endian trailer and the
``sharding_indexed`` index entry of a chunk that is not stored. The writer
(``chunk_writer``), the reader (``chunk_files``) and incremental reuse
(``_incremental.reuse``) compute names and checksums through it, and
:func:`extend_crc` is the package's one crc32c. Design notes: docs/chunk_files.md.
Pure functions: any thread.

The crc32c is the ``crc32c`` package's where it is installed: it releases the GIL on
any buffer of 32 KiB or more (numpy arrays included), so writer threads checksumming
chunks never stall the training thread. ``google_crc32c`` (the fallback) releases it
only for ``bytes`` of 1 MiB or more, never for numpy buffers: with 8 writer threads the
training thread waited tens of milliseconds per call (benchmarks/bench_onepass.py).

:func:`copy_crc` copies and checksums in one pass with the package's optional C
extension (``_copycrc.c``, built by setup.py where a compiler exists; it releases the
GIL too); where it is not built, with ``np.copyto`` then the crc32c above.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import numpy as np

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the fallback: holds the GIL on numpy buffers
    import google_crc32c

    def _crc32c(data, value: int = 0) -> int:
        return google_crc32c.extend(value, data)

    GIL_FREE_CRC = False
else:
    GIL_FREE_CRC = True

try:  # the optional C extension (setup.py): copies and checksums in one pass
    from . import _copycrc
except ImportError:  # not built (no compiler): np.copyto, then the crc32c above
    _copycrc = None

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


def file_name(path: str) -> str:
    """A version-1 chunk or batch file's name in errors: ``<array>/c/...`` (4 parts)."""
    return "/".join(path.split(os.sep)[-4:])


def stored_name(path: str, where: Callable[[str], str] | None, kind: str) -> str:
    """The words naming the stored bytes of chunk ``path`` in a damage error: the file
    of the format that wrote them (``where(path)``: a version-2 data file and its byte
    range), else version 1's own file (``<kind> <array>/c/...``)."""
    return where(path) if where is not None else f"{kind} {file_name(path)}"


def extend_crc(crc: int, data) -> int:
    """crc32c of the bytes so far (``crc``) followed by ``data`` (any C-contiguous
    buffer: bytes, memoryview, a numpy array of any dtype)."""
    return _crc32c(data, crc)


def whole_chunks(shape, chunk, index):
    """For the region ``index`` (global) of an array of ``shape``: (the region's shape,
    [(chunk grid cell, the cell's part of the region, relative to it), ...]); None when
    the region is empty or not whole chunks (a chunk cut by the array's end counts as
    whole)."""
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
    """The zarr3 ``crc32c`` codec's trailer of the bytes of ``parts`` one after another
    (C-contiguous arrays), as 4 uint8."""
    crc = 0
    for part in parts:
        crc = _crc32c(as_bytes(part), crc)
    return np.frombuffer(crc.to_bytes(CRC_BYTES, "little"), np.uint8)


def crc_matches(parts: list[np.ndarray], trailer: np.ndarray) -> bool:
    return np.array_equal(crc_trailer(parts), trailer)


def chunk_payload(view: np.ndarray, chunk: tuple[int, ...]) -> np.ndarray:
    """The stored bytes of one chunk (before its crc32c) from ``view``, the chunk's
    part of the array: zero-padded to the full ``chunk`` where the array's end cuts
    it, as tensorstore pads it."""
    if view.shape != chunk:  # cut by the array's end: zero-padded to the full chunk
        full = np.zeros(chunk, view.dtype)
        full[tuple(slice(0, n) for n in view.shape)] = view
        view = full
    elif not view.flags.c_contiguous:
        view = np.ascontiguousarray(view)
    return as_bytes(view)


def chunk_crcs(
    shape: tuple[int, ...], chunk: tuple[int, ...], index: tuple[slice, ...], data: np.ndarray
) -> dict[tuple[int, ...], int] | None:
    """``{chunk grid cell: crc32c}`` of every chunk of the region ``index`` (global) of
    an array of ``shape`` holding ``data`` (that region's values): the value the
    zarr3 ``crc32c`` codec stores as the trailer of each chunk file that
    :meth:`ChunkWriter.array` (or tensorstore) writes for it, computed over the same
    bytes (little endian, edge chunks zero-padded). None when the region is not whole
    chunks. A 0-d array is one chunk, cell ``()``. Any thread; reads ``data`` only."""
    if data.dtype.byteorder == ">":  # the stored encoding is little endian
        data = data.astype(data.dtype.newbyteorder("<"))
    if not shape:
        if data.shape != ():
            return None
        return {
            (): int.from_bytes(
                crc_trailer([as_bytes(np.ascontiguousarray(data))]).tobytes(), "little"
            )
        }
    region = whole_chunks(shape, chunk, index)
    if region is None or data.shape != region[0]:
        return None
    return {
        cell: int.from_bytes(
            crc_trailer([chunk_payload(data[at], tuple(chunk))]).tobytes(), "little"
        )
        for cell, at in region[1]
    }


COPY_STEP = 256 << 10  # without the kernel: bytes copied, then checksummed, at a time


def has_kernel() -> bool:
    """Whether the C kernel of :func:`copy_crc` is built (and imported) here."""
    return _copycrc is not None


def copy_crc(dst: np.ndarray, src: np.ndarray, crc: int = 0, kernel: bool | None = None) -> int:
    """``dst[...] = src`` for flat uint8 arrays of one size (C-contiguous, not
    overlapping); returns the crc32c of those bytes continued from ``crc`` (as
    :func:`extend_crc`). ``kernel``: None, the C kernel where it is built; True, the
    kernel (RuntimeError where it is not); False, ``np.copyto`` then the crc32c,
    :data:`COPY_STEP` bytes at a time (each piece checksummed while still in cache).
    Any thread: both release the GIL on large buffers."""
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
    """``np.copyto(dst, src)``, checksumming in the same pass: ``dst`` and ``src`` hold
    the region ``index`` (global) of an array of ``shape`` chunked by ``chunk``; where
    it is whole chunks, each chunk's crc32c (the value :func:`chunk_crcs` gives, the
    trailer its file stores) is put in ``out`` (``{chunk grid cell: crc32c}``).

    A chunk spanning whole rows (its trailing axes the array's) is copied by
    :func:`copy_crc` (``kernel``: which way), which checksums every byte as it copies it
    (the C kernel), or right after it copies each piece, still in the core's cache;
    the zero padding of a chunk cut by the array's end is checksummed after it. Other
    chunks are copied, then checksummed. Nothing is put in ``out`` for a region that
    is not whole chunks, a 0-d or big-endian array: the writer computes those. Any
    thread (the copies and the crc32c release the GIL); distinct calls put distinct
    cells."""
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


def as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat, read-only uint8 view (any dtype,
    ml_dtypes ones too; google_crc32c, the fallback crc, takes read-only buffers only)."""
    out = array.reshape(-1).view(np.uint8)
    out.flags.writeable = False
    return out


def advance(views: list[memoryview], done: int) -> None:
    """Drops ``done`` bytes from the front of ``views`` (a short read or write resumes
    mid-buffer)."""
    while done:
        if done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][done:]
            done = 0
