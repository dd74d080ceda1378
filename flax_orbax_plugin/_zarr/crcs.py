"""The crc32c of chunks: every chunk of a region at once, or each while the region is
copied (the optional C kernel, ``_copycrc``: it checksums every byte as it copies it).

Only a host copy that checksums as it goes (``_core.host_snapshot``) and incremental
steps' proofs of equal chunks run this; a chunk file's own trailer is
``chunks.crc_trailer``. Pure functions: any thread (the copies and the crc32c release
the GIL on large buffers).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.chunks``.
"""

from __future__ import annotations

import numpy as np

from .chunks import _crc32c, as_bytes, chunk_payload, crc_trailer, whole_chunks

try:  # the optional C extension (setup.py): copies and checksums in one pass
    from . import _copycrc
except ImportError:  # not built (no compiler): np.copyto, then the crc32c of ``chunks``
    _copycrc = None


def extend_crc(crc: int, data) -> int:
    """crc32c of the bytes so far (``crc``) followed by ``data`` (any C-contiguous
    buffer: bytes, memoryview, a numpy array of any dtype)."""
    return _crc32c(data, crc)


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
