"""What each leaf of a tree being saved is: its kind, its value as saved, its writer.

:func:`classify` turns a pytree leaf into (kind, the value to save, the PRNG key
implementation or None), refusing what cannot be saved with a StructureError naming
the leaf's path; :func:`writer_process` and :func:`is_partitioned` say who writes an
unpartitioned leaf and whether a leaf is split over devices; :class:`DocumentSize`
bounds what the leaves put into ``_METADATA.json`` (and refuses a path no reader
accepts). Pure functions of the leaf, called by ``plan`` on the caller's thread.
"""

from __future__ import annotations

import base64
import functools
import json
from typing import Any

import jax
import numpy as np

from .._base import tree as _tree
from .._errors import StructureError
from .._format import layout as _layout
from .._storage import json_docs as _docs


def _text(path: str, leaf: str | bytes) -> str:
    """A str or bytes leaf as the record's JSON string (bytes base64), bounded."""
    raw = _utf8(leaf, f"leaf {path!r}: a str") if isinstance(leaf, str) else leaf
    if len(raw) > _layout.MAX_TEXT_BYTES:
        raise StructureError(
            f"leaf {path!r}: a {type(leaf).__name__} of {len(raw)} bytes; str and bytes "
            f"leaves are kept in the metadata, at most {_layout.MAX_TEXT_BYTES} bytes each "
            f"(store larger data as a numpy uint8 array)"
        )
    return leaf if isinstance(leaf, str) else base64.b64encode(raw).decode("ascii")


def _utf8(text: str, what: str) -> bytes:
    """``text`` in UTF-8; StructureError naming ``what`` for text no reader accepts
    (a lone surrogate: no JSON document of the format can hold it)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StructureError(
            f"{what} that UTF-8 cannot encode: {e.reason} ({text[e.start : e.end]!r} at "
            f"character {e.start}); a checkpoint's metadata holds UTF-8 text only"
        ) from None


class DocumentSize:
    """A lower bound of the bytes of ``_METADATA.json`` while a plan is built, so a
    tree whose metadata no reader accepts (``json_docs.METADATA``) is refused before
    anything is staged; :meth:`add` also refuses a leaf path UTF-8 cannot encode (a
    dict key with a lone surrogate). The exact size is checked when it is encoded."""

    _PER_LEAF = len('{"path":"","keys":[],"kind":""}')

    def __init__(self):
        self.bytes = 0
        self.leaves = 0
        self.text_leaves = 0

    def add(self, path: str, text: str | None) -> None:
        if not path.isascii():
            _utf8(path, f"leaf path {path!r}: a key")
        self.leaves += 1
        self.bytes += self._PER_LEAF + len(path)
        if text is not None:
            self.text_leaves += 1
            self.bytes += len(json.dumps(text))  # as the record holds it (escaped)

    def check(self) -> None:
        limit = _docs.METADATA.max_bytes
        if self.bytes > limit:
            raise StructureError(
                f"{_layout.METADATA_FILE} of this tree would hold more than {self.bytes} "
                f"bytes ({self.leaves} leaves, {self.text_leaves} of them str or bytes, "
                f"kept in it), more than a reader accepts ({limit}); store large text as "
                f"numpy uint8 arrays, or save fewer leaves per checkpoint"
            )


def _check_live(path: str, leaf: jax.Array) -> None:
    """A traced value or a deleted (donated) array holds nothing to save: named here."""
    if isinstance(leaf, jax.core.Tracer):
        raise StructureError(
            f"leaf {path!r}: expected a concrete array, found a traced value (inside "
            f"jax.jit, grad or vmap): save outside the transformed function, from its output"
        )
    if leaf.is_deleted():
        raise StructureError(
            f"leaf {path!r}: expected a live array, found one that was deleted (donated "
            f"to a jitted step with donate_argnums, or .delete()d): save the state the "
            f"step returned, or before the step that donates it"
        )


def classify(path: str, leaf: Any) -> tuple[str, Any, str | None]:
    """(kind, array-like value, PRNG impl) for one leaf; errors name the path."""
    if leaf is None:
        return "none", None, None
    if isinstance(leaf, jax.Array):
        _check_live(path, leaf)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(leaf))
            return "prng_key", jax.random.key_data(leaf), impl
        return "array", leaf, None
    if isinstance(leaf, np.generic):  # before float: np.float64 is a float, kept numpy
        return "np_scalar", native_order(np.asarray(leaf)), None
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
    if isinstance(leaf, np.ndarray):
        if isinstance(leaf, np.ma.MaskedArray):
            raise StructureError(
                f"leaf {path!r}: expected a plain numpy array, found a numpy masked array "
                "(its mask would be lost); save its .data and .mask as two leaves, or "
                "np.ma.filled(...) it"
            )
        return "array", native_order(leaf), None
    if isinstance(leaf, str | bytes):
        return "py_str" if isinstance(leaf, str) else "py_bytes", _text(path, leaf), None
    if _tree.is_empty_node(leaf):
        return _tree.empty_kind(leaf), None, None
    raise StructureError(
        f"leaf {path!r}: expected a jax.Array, numpy array, scalar, str, bytes or None, "
        f"found {type(leaf).__module__}.{type(leaf).__qualname__}"
    )


def native_order(value: np.ndarray) -> np.ndarray:
    """``value`` in this host's byte order. The files hold little-endian bytes under the
    dtype's name (``int32``, not ``>i4``): a big-endian array (FITS, some ``.npy`` and
    ``.mat`` files) is converted (a copy), never written as its raw bytes."""
    if value.dtype.isnative:
        return value
    return value.astype(value.dtype.newbyteorder("="))


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
