"""Sub-byte dtypes (int1/2/4, uint1/2/4, float4_e2m1fn, float6_*) stored packed.

numpy (ml_dtypes) holds one such value per byte. A leaf of one, stored as its own
array, is written packed when its chunks allow it: storage
``{"type": "packed_array"}``, a zarr3 ``uint8`` array whose last axis holds each row's
values as one little-endian bit stream (value ``j`` of a row at bits
``[j * bits, (j + 1) * bits)``, bit ``k`` of the row being bit ``k % 8`` of byte
``k // 8``; the bits after a row's last value are zero), so ``ceil(n * bits / 8)``
bytes per row of ``n`` values. The last axis of a chunk spans ``chunk * bits / 8``
whole bytes, or the whole row: every chunk starts on a byte, and no two writers share
one. Layout: FORMAT.md ("Packed sub-byte arrays").

:func:`stored` gives the record of the array as stored (what chunk geometry, claims,
specs and reuse compute with); :func:`pack_write` turns one region of values into the
stored region and bytes; :func:`unpacked_read` wraps a read of the stored bytes into
one of the values. Which leaves are packed: ``_format.layout.packable``. Pure
functions: any thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._errors import CheckpointError
from .._format.layout import DTYPES, ArrayStorage, LeafRecord, dtype_from_name


def bits_of(dtype_name: str) -> int:
    return DTYPES[dtype_name].bits


def _nbytes(values: int, bits: int) -> int:
    return -(-values * bits // 8)


def is_packed(record: LeafRecord) -> bool:
    return isinstance(record.storage, ArrayStorage) and record.storage.packed


def stored(record: LeafRecord) -> LeafRecord:
    """``record`` as its zarr3 array stores it: itself, or for a packed leaf a ``uint8``
    record whose shape and chunk shape hold the packed bytes along the last axis."""
    if not is_packed(record):
        return record
    bits = bits_of(record.dtype)
    storage = record.storage
    shape = (*record.shape[:-1], _nbytes(record.shape[-1], bits))
    chunk = (*storage.chunk_shape[:-1], _nbytes(storage.chunk_shape[-1], bits))
    return dataclasses.replace(
        record,
        shape=shape,
        dtype="uint8",
        storage=dataclasses.replace(storage, chunk_shape=chunk, packed=False),
    )


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` (a sub-byte dtype, any shape of at least one axis) as packed rows:
    uint8 of shape ``(..., ceil(n * bits / 8))``."""
    low = np.ascontiguousarray(values).view(np.uint8) & np.uint8((1 << bits) - 1)
    if bits == 4:
        if low.shape[-1] % 2:
            low = np.concatenate([low, np.zeros((*low.shape[:-1], 1), np.uint8)], axis=-1)
        return low[..., 0::2] | (low[..., 1::2] << 4)
    planes = np.unpackbits(low[..., None], axis=-1, bitorder="little")[..., :bits]
    return np.packbits(planes.reshape(*low.shape[:-1], -1), axis=-1, bitorder="little")


def unpack_rows(packed: np.ndarray, bits: int, width: int, first_bit: int, dtype) -> np.ndarray:
    """``width`` values per row of ``packed`` (uint8 rows), the first at bit
    ``first_bit`` of each row: an array of ``dtype`` (one canonical byte each)."""
    packed = np.asarray(packed, np.uint8)
    if bits == 4 and first_bit in (0, 4):
        out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
        out[..., 0::2], out[..., 1::2] = packed & 0xF, packed >> 4
        start = first_bit // 4
        return np.ascontiguousarray(out[..., start : start + width]).view(dtype)
    stream = np.unpackbits(packed, axis=-1, bitorder="little")
    stream = stream[..., first_bit : first_bit + width * bits]
    values = np.packbits(
        stream.reshape(*packed.shape[:-1], width, bits), axis=-1, bitorder="little"
    )
    return np.ascontiguousarray(values[..., 0]).view(dtype)


def _last_axis(index, n: int) -> tuple[int, int]:
    start, stop, step = index[-1].indices(n)
    if step != 1:
        raise CheckpointError(f"a strided region {index} of a packed array")
    return start, stop


def pack_write(record: LeafRecord, index: tuple, data: np.ndarray) -> tuple[tuple, np.ndarray]:
    """One region (``index``, global, whole chunks) of a packed leaf and its values:
    the stored array's region and its bytes."""
    bits, n = bits_of(record.dtype), record.shape[-1]
    start, stop = _last_axis(index, n)
    if start * bits % 8 or (stop * bits % 8 and stop != n):
        raise CheckpointError(
            f"leaf {record.path!r}: a region {index} whose last axis is not on whole bytes "
            f"of its packed {record.dtype} chunks"
        )
    region = (*index[:-1], slice(start * bits // 8, _nbytes(stop, bits)))
    return region, pack_rows(np.asarray(data), bits)


class Unpacked:
    """A read of a packed leaf's stored bytes that gives the leaf's values."""

    def __init__(self, read: Any, record: LeafRecord, width: int, first_bit: int):
        self.read, self.bits = read, bits_of(record.dtype)
        self.width, self.first_bit = width, first_bit
        self.dtype = dtype_from_name(record.dtype, path=record.path)
        self.deferred = getattr(read, "deferred", False)

    def result(self) -> np.ndarray:
        return unpack_rows(self.read.result(), self.bits, self.width, self.first_bit, self.dtype)


def stored_region(record: LeafRecord, region) -> tuple[tuple, int, int]:
    """For a read of ``region`` (global; None: all) of a packed leaf: (the stored
    array's region holding it, the values per row, the bit of each row's first one)."""
    bits, n = bits_of(record.dtype), record.shape[-1]
    index = tuple(region) if region is not None else (slice(None),) * len(record.shape)
    start, stop = _last_axis(index, n)
    inner = (*index[:-1], slice(start * bits // 8, _nbytes(stop, bits)))
    return inner, stop - start, start * bits % 8
