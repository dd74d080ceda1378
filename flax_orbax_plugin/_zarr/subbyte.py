"""How sub-byte values pack into bytes: a packed leaf's stored array, its regions, its
values (FORMAT.md). Pure functions: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.chunks``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from .._errors import CheckpointError
from .._format.layout import DTYPES, LeafRecord, dtype_from_name
from .chunks import is_packed


def bits_of(dtype_name: str) -> int:
    return DTYPES[dtype_name].bits


def _nbytes(values: int, bits: int) -> int:
    return -(-values * bits // 8)


def stored(record: LeafRecord) -> LeafRecord:
    """``record`` as its zarr3 array stores it: itself, or a packed leaf's ``uint8`` bytes."""
    if not is_packed(record):
        return record
    bits, chunk = bits_of(record.dtype), record.storage.chunk_shape
    shape = (*record.shape[:-1], _nbytes(record.shape[-1], bits))
    chunk = (*chunk[:-1], _nbytes(chunk[-1], bits))
    storage = dataclasses.replace(record.storage, chunk_shape=chunk, packed=False)
    return dataclasses.replace(record, shape=shape, dtype="uint8", storage=storage)


def group(bits: int) -> int:
    """Values per group of whole bytes (6-bit: 4 in 3 bytes); a row's groups start on bytes."""
    return 8 // math.gcd(bits, 8)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` (a sub-byte dtype, at least one axis) as uint8 packed rows."""
    low = np.ascontiguousarray(values).view(np.uint8) & np.uint8((1 << bits) - 1)
    n, g = low.shape[-1], group(bits)
    if n % g:
        pad = np.zeros((*low.shape[:-1], g - n % g), np.uint8)
        low = np.concatenate([low, pad], axis=-1)
    lanes = low.reshape(*low.shape[:-1], -1, g)
    wide = np.uint32 if g * bits > 8 else np.uint8
    word = np.zeros(lanes.shape[:-1], wide)
    for j in range(g):
        word |= lanes[..., j].astype(wide) << wide(j * bits)
    per = g * bits // 8  # bytes per group
    out = np.empty((*word.shape, per), np.uint8)
    for i in range(per):
        out[..., i] = word >> wide(8 * i) if per > 1 else word
    return out.reshape(*low.shape[:-1], -1)[..., : _nbytes(n, bits)]


def unpack_rows(packed: np.ndarray, bits: int, width: int, skip: int, dtype) -> np.ndarray:
    """Values ``skip .. skip + width`` of each row of ``packed``, as ``dtype``."""
    packed = np.asarray(packed, np.uint8)
    g = group(bits)
    per = g * bits // 8
    if packed.shape[-1] % per:
        pad = np.zeros((*packed.shape[:-1], per - packed.shape[-1] % per), np.uint8)
        packed = np.concatenate([packed, pad], axis=-1)
    groups = packed.reshape(*packed.shape[:-1], -1, per)
    wide = np.uint32 if per > 1 else np.uint8
    word = groups[..., 0].astype(wide)
    for i in range(1, per):
        word |= groups[..., i].astype(wide) << wide(8 * i)
    mask = wide((1 << bits) - 1)
    out = np.empty((*word.shape, g), np.uint8)
    for j in range(g):
        out[..., j] = (word >> wide(j * bits)) & mask
    out = out.reshape(*packed.shape[:-1], -1)
    return np.ascontiguousarray(out[..., skip : skip + width]).view(dtype)


def pack_flat(values: np.ndarray) -> np.ndarray:
    """A small leaf's values (a sub-byte dtype) as one bit stream: its ``packed_batch`` slot."""
    flat = np.ascontiguousarray(values).reshape(-1)
    return pack_rows(flat, bits_of(flat.dtype.name))


def unpack_flat(data: np.ndarray, record: LeafRecord) -> np.ndarray:
    """The values of a ``packed_batch`` leaf from its slot's bytes (flat)."""
    count = math.prod(record.shape)
    dtype = dtype_from_name(record.dtype, path=record.path)
    return unpack_rows(np.asarray(data).reshape(-1), bits_of(record.dtype), count, 0, dtype)


def _last_axis(index, n: int) -> tuple[int, int]:
    start, stop, step = index[-1].indices(n)
    if step != 1:
        raise CheckpointError(f"a strided region {index} of a packed array")
    return start, stop


def pack_write(record: LeafRecord, index: tuple, data: np.ndarray) -> tuple[tuple, np.ndarray]:
    """The stored array's region and bytes of region ``index`` (global) of a packed leaf."""
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

    def __init__(self, read: Any, record: LeafRecord, width: int, skip: int):
        self.read, self.bits = read, bits_of(record.dtype)
        self.width, self.skip = width, skip
        self.dtype = dtype_from_name(record.dtype, path=record.path)
        self.deferred = getattr(read, "deferred", False)

    def result(self) -> np.ndarray:
        return unpack_rows(self.read.result(), self.bits, self.width, self.skip, self.dtype)


def stored_region(record: LeafRecord, region) -> tuple[tuple, int, int]:
    """(stored region, values per row, values to skip per row) of a packed leaf's ``region``."""
    bits, n = bits_of(record.dtype), record.shape[-1]
    index = tuple(region) if region is not None else (slice(None),) * len(record.shape)
    start, stop = _last_axis(index, n)
    first = start - start % group(bits)
    inner = (*index[:-1], slice(first * bits // 8, _nbytes(stop, bits)))
    return inner, stop - start, start - first
