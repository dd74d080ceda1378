"""What each leaf of a tree being saved is: its kind, its value as saved, its writer.

:func:`classify` turns a pytree leaf into (kind, the value to save, the PRNG key
implementation or None), refusing what cannot be saved with a StructureError naming
the leaf's path; :func:`writer_process` and :func:`is_partitioned` say who writes an
unpartitioned leaf and whether a leaf is split over devices. Pure functions of the
leaf, called by ``plan`` on the caller's thread.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

import jax
import numpy as np

from .._base import tree as _tree
from .._errors import StructureError
from .._format import layout as _layout


def _text(path: str, leaf: str | bytes) -> str:
    """A str or bytes leaf as the record's JSON string (bytes base64), bounded."""
    raw = leaf.encode("utf-8") if isinstance(leaf, str) else leaf
    if len(raw) > _layout.MAX_TEXT_BYTES:
        raise StructureError(
            f"leaf {path!r}: a {type(leaf).__name__} of {len(raw)} bytes; str and bytes "
            f"leaves are kept in the metadata, at most {_layout.MAX_TEXT_BYTES} bytes each "
            f"(store larger data as a numpy uint8 array)"
        )
    return leaf if isinstance(leaf, str) else base64.b64encode(raw).decode("ascii")


def classify(path: str, leaf: Any) -> tuple[str, Any, str | None]:
    """(kind, array-like value, PRNG impl) for one leaf; errors name the path."""
    if leaf is None:
        return "none", None, None
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(leaf))
            return "prng_key", jax.random.key_data(leaf), impl
        return "array", leaf, None
    if isinstance(leaf, bool):
        return "py_bool", np.asarray(leaf, dtype=np.bool_), None
    if isinstance(leaf, int):
        if not -(2**63) <= leaf < 2**63:
            raise StructureError(f"leaf {path!r}: expected an int that fits int64, found {leaf}")
        return "py_int", np.asarray(leaf, dtype=np.int64), None
    if isinstance(leaf, float):
        return "py_float", np.asarray(leaf, dtype=np.float64), None
    if isinstance(leaf, complex):
        return "py_complex", np.asarray(leaf, dtype=np.complex128), None
    if isinstance(leaf, np.generic):
        return "np_scalar", np.asarray(leaf), None
    if isinstance(leaf, np.ndarray):
        return "array", leaf, None
    if isinstance(leaf, str | bytes):
        return "py_str" if isinstance(leaf, str) else "py_bytes", _text(path, leaf), None
    if _tree.is_empty_node(leaf):
        return _tree.empty_kind(leaf), None, None
    raise StructureError(
        f"leaf {path!r}: expected a jax.Array, numpy array, scalar, str, bytes or None, "
        f"found {type(leaf).__module__}.{type(leaf).__qualname__}"
    )


@functools.lru_cache(maxsize=4096)
def _first_device(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> jax.Device:
    return next(iter(sharding.devices_indices_map(shape)))


def writer_process(value: Any) -> int:
    """Process that writes an unpartitioned leaf: the owner of replica 0."""
    if isinstance(value, jax.Array):
        return _first_device(value.sharding, value.shape).process_index
    return 0


def is_partitioned(value: Any) -> bool:
    return isinstance(value, jax.Array) and not value.sharding.is_fully_replicated
