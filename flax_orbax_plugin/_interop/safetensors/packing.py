"""Sub-byte tensors of safetensors (``F4``, ``F6_E2M3``, ``F6_E3M2``): packed bits.

The spec sizes such a tensor as ``elements * bits / 8`` bytes (a whole number: the
real library refuses any other). This library packs the elements in C order into one
little-endian bit stream: element ``k`` holds bits ``[k * bits, (k + 1) * bits)``,
bit ``j`` of the stream being bit ``j % 8`` (least significant first) of byte
``j // 8``. For ``F4`` that is two values per byte, the first in the low nibble, as
PyTorch's ``float4_e2m1fn_x2`` and MXFP4 checkpoints store them. In memory
(ml_dtypes) each value is one byte, its bits low and the rest zero. Pure functions:
any thread.
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
    """Bytes of ``count`` values of ``dtype`` in a safetensors file; None where packed
    values do not fill whole bytes (the spec has no such tensor)."""
    bits = packed_bits(dtype)
    if bits is None:
        return count * dtype.itemsize
    return None if count * bits % 8 else count * bits // 8


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """The packed bytes (uint8, flat) of ``values`` (C order; their count times
    ``bits`` a multiple of 8): the whole tensor as one row (``_zarr.chunks``)."""
    return _subbyte.pack_rows(np.ascontiguousarray(values).reshape(-1), bits)


def unpack(data: np.ndarray, bits: int, count: int, skip: int = 0) -> np.ndarray:
    """Values ``skip .. skip + count`` (one canonical byte each, uint8) of the packed
    bytes ``data`` (uint8, starting on a group of whole bytes: ``_zarr.subbyte.group``)."""
    return _subbyte.unpack_rows(data, bits, count, skip, np.uint8)


def group(bits: int) -> int:
    return _subbyte.group(bits)
