"""Sub-byte tensors of safetensors (``F4``, ``F6_E2M3``, ``F6_E3M2``): packed bits.

A tensor is ``elements * bits / 8`` bytes (a whole number), the elements in C order in
one little-endian bit stream (``F4``: the first value in the low nibble, as PyTorch's
``float4_e2m1fn_x2`` stores them). Pure functions: any thread.
"""

from __future__ import annotations

import numpy as np

from ..._format import layout as _layout
from ..._zarr import subbyte as _subbyte


def packed_bits(dtype: np.dtype) -> int | None:
    """The bits per value of a dtype safetensors stores packed; None for whole bytes."""
    entry = _layout.DTYPES.get(dtype.name)
    return entry.bits if entry is not None and entry.bits < 8 else None


def tensor_nbytes(dtype: np.dtype, count: int) -> int | None:
    """Bytes of ``count`` values of ``dtype``; None where packed values are no whole bytes."""
    bits = packed_bits(dtype)
    if bits is None:
        return count * dtype.itemsize
    return None if count * bits % 8 else count * bits // 8


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """The packed bytes (uint8, flat) of ``values``: the whole tensor as one row."""
    return _subbyte.pack_rows(np.ascontiguousarray(values).reshape(-1), bits)


def unpack(data: np.ndarray, bits: int, count: int, skip: int = 0) -> np.ndarray:
    """Values ``skip .. skip + count`` (uint8 each) of the packed bytes ``data``
    (starting on a group of whole bytes: ``_zarr.subbyte.group``)."""
    return _subbyte.unpack_rows(data, bits, count, skip, np.uint8)
