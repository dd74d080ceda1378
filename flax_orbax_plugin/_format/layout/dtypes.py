"""The dtypes a checkpoint may hold, declared once: their names, bits, zarr3 data types and
safetensors tags, numpy's dtype of a stored name, and how sub-byte dtypes pack.

Pure functions over an immutable table (the lookups cached): any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.layout.records``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import numpy as np

from ..._errors import StructureError


@dataclasses.dataclass(frozen=True)
class Dtype:
    """One dtype a checkpoint may hold. ``name``: numpy's (ml_dtypes'), as records store
    it; ``bits``: of one value (under 8: sub-byte, one value per byte in memory);
    ``zarr``: its arrays' zarr3 ``data_type`` (its own name where tensorstore knows it,
    else ``uint8``: the same byte per value); ``safetensors``: its tag, or None."""

    name: str
    bits: int
    zarr: str
    safetensors: str | None


def _table(rows: str) -> dict[str, Dtype]:
    out = {}
    for row in rows.strip().splitlines():
        name, bits, zarr, tag = row.split()
        zarr = name if zarr == "=" else zarr
        out[name] = Dtype(name, int(bits), zarr, None if tag == "-" else tag)
    return out


# name, bits, zarr3 data_type ("=": its own name), safetensors tag ("-": none). Every
# dtype jax.numpy offers (tests/format/test_every_dtype.py fails for one not listed).
DTYPES = _table(
    """
    bool                8   =       BOOL
    int1                1   uint8   -
    int2                2   =       -
    int4                4   =       -
    int8                8   =       I8
    int16               16  =       I16
    int32               32  =       I32
    int64               64  =       I64
    uint1               1   uint8   -
    uint2               2   uint8   -
    uint4               4   uint8   -
    uint8               8   =       U8
    uint16              16  =       U16
    uint32              32  =       U32
    uint64              64  =       U64
    float4_e2m1fn       4   =       F4
    float6_e2m3fn       6   uint8   F6_E2M3
    float6_e3m2fn       6   uint8   F6_E3M2
    float8_e3m4         8   =       -
    float8_e4m3         8   uint8   -
    float8_e4m3b11fnuz  8   =       -
    float8_e4m3fn       8   =       F8_E4M3
    float8_e4m3fnuz     8   =       F8_E4M3FNUZ
    float8_e5m2         8   =       F8_E5M2
    float8_e5m2fnuz     8   =       F8_E5M2FNUZ
    float8_e8m0fnu      8   =       F8_E8M0
    float16             16  =       F16
    bfloat16            16  =       BF16
    float32             32  =       F32
    float64             64  =       F64
    complex64           64  =       C64
    complex128          128 =       -
    """
)


SUPPORTED_DTYPES = frozenset(DTYPES)
# The dtypes numpy itself has; every other one is ml_dtypes', imported at the first
# such dtype resolved (0.3-0.9 s: a command that reads only JSON never pays it).
NUMPY_NATIVE = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
    "complex64 complex128".split()
)


@functools.lru_cache(maxsize=256)
def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached (numpy computes it anew on every access)."""
    return dtype.name


@functools.lru_cache(maxsize=64)
def dtype_from_name(name: str, *, path: str = "?") -> np.dtype:
    """numpy dtype for a stored dtype name; a clear error for unknown names."""
    if name not in SUPPORTED_DTYPES:
        raise StructureError(
            f"leaf {path!r}: unknown dtype {name!r} (expected one of {sorted(SUPPORTED_DTYPES)})"
        )
    if name in NUMPY_NATIVE:
        return np.dtype(name)
    return np.dtype(getattr(importlib.import_module("ml_dtypes"), name))


def packable(name: str, shape, chunk) -> bool:
    """Whether a leaf of dtype ``name``, ``shape`` and ``chunk`` shape is stored packed
    (``packed_array``): a sub-byte dtype, at least one axis and no empty one, and
    chunks whose last axis is whole bytes (or the whole axis). FORMAT.md."""
    bits = DTYPES[name].bits
    if bits >= 8 or not shape or 0 in shape:
        return False
    return chunk[-1] == shape[-1] or chunk[-1] * bits % 8 == 0


def packed_bytes(name: str, count: int) -> int:
    """Bytes of ``count`` values of a sub-byte dtype packed into one bit stream."""
    return -(-count * DTYPES[name].bits // 8)
