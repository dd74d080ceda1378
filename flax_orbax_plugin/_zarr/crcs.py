"""The crc32c of chunks: every chunk of a region at once, or each while the region is
copied (the optional C kernel ``_copycrc`` checksums every byte as it copies it). Pure
functions: any thread (the copies and the crc32c release the GIL on large buffers).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.chunks``.
"""

from __future__ import annotations

import numpy as np

from .chunks import _crc32c, as_bytes, chunk_payload, whole_chunks

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
    """``{chunk grid cell: crc32c}`` of every chunk of the region ``index`` (global) of an
    array of ``shape`` holding ``data``: the trailer each chunk file stores (little
    endian, edge chunks zero-padded). None when the region is not whole chunks. A 0-d
    array is one chunk, cell ``()``."""
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
    """``np.copyto(dst, src)`` for the region ``index`` (global) of an array of ``shape``
    chunked by ``chunk``, putting each chunk's crc32c (as :func:`chunk_crcs`) in ``out``
    where the region is whole chunks. A chunk of whole rows is copied and checksummed
    in one pass by :func:`copy_crc` (``kernel``: which way), others copied then
    checksummed. Nothing is put for a 0-d or big-endian array: the writer computes those."""
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
