"""dtype names, leaf kinds and the bounds of format version 1.

The dtypes zarr3 stores (by numpy name), the leaf kinds a record may have, and the
limits past which a number in a checkpoint's JSON is damage, not data.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from ..._errors import StructureError
from ..._storage import json_docs as _docs

MAX_JSON_BYTES = _docs.METADATA.max_bytes  # the limits of every kind: _storage/json_docs.py
MAX_NDIM = 64
MAX_ARRAY_BYTES = 1 << 50  # 1 PiB: larger "arrays" are damage, not data
MAX_PROCESSES = 1 << 20

# dtypes zarr3 (as tensorstore implements it) stores, by numpy name.
SUPPORTED_DTYPES = frozenset(
    "bool int4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 float8_e4m3fn "
    "float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 float8_e5m2fnuz float16 bfloat16 "
    "float32 float64 complex64 complex128".split()
)
PRNG_IMPLS = frozenset({"threefry2x32", "rbg", "unsafe_rbg"})
EMPTY_KINDS = ("empty_dict", "empty_list")  # {} (or a field-less node); [] or ()
# A str or bytes leaf: its value is JSON in the record ("value"; bytes as base64).
TEXT_KINDS = ("py_str", "py_bytes")
MAX_TEXT_BYTES = 64 << 10  # per str (UTF-8) or bytes leaf: larger belongs in an array
NO_DATA_KINDS = ("none", *EMPTY_KINDS, *TEXT_KINDS)  # no shape, dtype, storage or files
LEAF_KINDS = frozenset(
    {"array", "py_int", "py_float", "py_bool", "py_complex", "np_scalar", "prng_key"}
    | set(NO_DATA_KINDS)
)
KEY_KINDS = frozenset({"dict", "seq", "attr", "flat"})
PRNG_KEY_WORDS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}  # uint32 words per key
_REAL = SUPPORTED_DTYPES - {"complex64", "complex128"}
# Python and numpy scalars: shape [] and a dtype their Python type can be made from.
SCALAR_KINDS = {
    "py_int": _REAL,
    "py_float": _REAL,
    "py_bool": _REAL,
    "py_complex": SUPPORTED_DTYPES,
    "np_scalar": SUPPORTED_DTYPES,
}


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
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
