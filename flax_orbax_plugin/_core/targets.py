"""The targets of a restore: one per leaf read, checked against ``like``, and the
leaf's final form once its bytes are on the host.

:func:`make_target` checks a saved record against its ``like`` leaf (kind, shape,
dtype) before anything is read; :func:`finish` casts and converts the host data,
and :class:`Placer` batches the host-to-device transfers. All on the restoring thread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

try:  # private: the transfer jax.device_put makes per array (see _put_on_one_device)
    from jax._src import core as _jax_core
    from jax._src.lib import xla_client as _xla_client

    _direct_put = _xla_client.batched_device_put
except (ImportError, AttributeError):  # another jax: jax.device_put, as before
    _jax_core, _direct_put = None, None

from .._base import tree as _tree
from .._errors import StructureError
from .._format import layout as _layout
from .._format.layout import BatchStorage, LeafRecord
from .._like import casting as _casting
from .._like import onto_like as _onto_like
from .._zarr import subbyte as _subbyte


@dataclasses.dataclass
class Target:
    index: int  # leaf number in the checkpoint
    record: LeafRecord
    like: Any
    dtype: np.dtype | None = None  # saved dtype
    out_dtype: Any = None
    result: Any = None
    cast: str = "safe"  # the read's cast policy (ReadRequest.cast)
    # a leaf layout surgery made (``_like.surgery.Made``): read through its node's
    # pieces; ``record`` is then its stand-in (shape and dtype, no storage)
    virtual: Any = None


def _describe(x: Any) -> str:
    if x is None:
        return "None"
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None:
        return f"{type(x).__name__}(shape={tuple(shape)}, dtype={dtype})"
    return type(x).__name__


def make_target(index: int, record: LeafRecord, like: Any, *, cast: str) -> Target:
    """The target of one saved leaf read onto ``like``, cast under ``cast``."""
    path = record.path
    target = Target(index, record, like, cast=cast)
    if record.kind in _layout.EMPTY_KINDS:
        return _empty_target(target)
    if record.kind in _layout.TEXT_KINDS:
        return _text_target(target)
    if record.kind == "none":
        if like is not None and _tree.is_empty_node(like):
            target.result = like  # holds no data either: EmptyState() saved as None (Orbax)
            return target
        if like is not None:
            raise StructureError(
                f"leaf {path!r}: expected {_describe(like)} (from like), "
                f"found None in the checkpoint"
            )
        return target
    target.dtype = _layout.dtype_from_name(record.dtype, path=path)
    saved_shape = record.shape
    if record.kind == "prng_key":
        _check_key_like(record, like)  # its shape is checked after wrapping
        return target
    if like is None:
        target.out_dtype = target.dtype
        return target
    like_shape, like_dtype = _onto_like.template_of(path, like)
    if _onto_like.is_key_dtype(like_dtype):
        raise StructureError(
            f"leaf {path!r}: expected a PRNG key array (from like), "
            f"found {record.dtype}{list(saved_shape)} in the checkpoint"
        )
    if like_shape != saved_shape:
        raise StructureError(
            f"leaf {path!r}: shape mismatch: expected {like_shape} (from like), "
            f"found {saved_shape} in the checkpoint"
        )
    target.out_dtype = np.dtype(like_dtype)
    sharding = getattr(like, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):  # one that cannot hold it: named here
        try:
            sharding.shard_shape(tuple(saved_shape))
        except ValueError as e:  # jax's IndivisibleError is one
            raise StructureError(
                f"leaf {path!r}: the sharding of like cannot hold its shape "
                f"{tuple(saved_shape)}: {e}"
            ) from None
    return target


def _text_target(target: Target) -> Target:
    """A str or bytes leaf: its value is in the record; ``like`` None or of its type."""
    value = _layout.text_value(target.record)
    like = target.like
    if like is not None and type(like) is not type(value):
        raise StructureError(
            f"leaf {target.record.path!r}: expected {_describe(like)} (from like), found a "
            f"{type(value).__name__} in the checkpoint"
        )
    target.result = value
    return target


def _empty_target(target: Target) -> Target:
    """An empty node ({}, [], EmptyState()): no data; the result is ``like`` itself."""
    like, kind = target.like, target.record.kind
    if like is not None and not _tree.is_empty_node(like):
        raise StructureError(
            f"leaf {target.record.path!r}: expected {_describe(like)} (from like), found an "
            f"empty {'list' if kind == 'empty_list' else 'node'} in the checkpoint"
        )
    target.result = _tree.empty_value(kind) if like is None else like
    return target


def add_missing_empties(flat: list, records: dict[str, tuple[int, LeafRecord]]) -> None:
    """Empty nodes of ``like`` that a checkpoint does not record (written before empty
    nodes were recorded) hold no data: they are restored as they are in ``like``."""
    for path, keys, leaf in flat:
        if path not in records and _tree.is_empty_node(leaf):
            kind = _tree.empty_kind(leaf)
            records[path] = (-1, LeafRecord(path, tuple(tuple(k) for k in keys), kind))


def _check_key_like(record: Any, like: Any) -> None:
    """A saved PRNG key array restores only into a key of its own impl (a key's words
    mean nothing under another impl: no cast), before anything is read."""
    if like is None:
        return
    shape, dtype = _onto_like.template_of(record.path, like)
    found = f"a PRNG key array of impl {record.impl!r} in the checkpoint"
    if not _onto_like.is_key_dtype(dtype):
        raise StructureError(
            f"leaf {record.path!r}: expected {dtype}{list(shape)} (from like), found "
            f"{found}; restore it into a key (jax.random.key(0, impl={record.impl!r}) or "
            f"its eval_shape), then jax.random.key_data(...) for its raw words"
        )
    impl = getattr(getattr(dtype, "_impl", None), "name", None)
    if impl is not None and impl != record.impl:
        raise StructureError(
            f"leaf {record.path!r}: expected a PRNG key of impl {impl!r} (from like), "
            f"found {found}; a key of one impl cannot be read as another"
        )


def finish(target: Target, host: np.ndarray, placer: Placer) -> None:
    """Turns host data into the leaf's final form (cast, scalar) in ``target.result``;
    device placement goes through ``placer``."""
    value = _final_value(target, host)
    if isinstance(value, tuple):  # (host, sharding): batched device_put
        placer.add(target, *value)
    else:
        target.result = value


def _final_value(target: Target, host: np.ndarray) -> Any:
    record, like = target.record, target.like
    kind = record.kind
    if isinstance(record.storage, BatchStorage) and record.storage.packed:
        host = _subbyte.unpack_flat(host, record)  # a sub-byte leaf's packed bytes
    host = host.reshape(record.shape)
    if kind == "prng_key":
        keys = jax.random.wrap_key_data(host, impl=record.impl)
        if like is not None:
            if tuple(like.shape) != keys.shape:
                raise StructureError(
                    f"leaf {record.path!r}: shape mismatch: expected {tuple(like.shape)} "
                    f"(from like), found {keys.shape} in the checkpoint"
                )
            sharding = getattr(like, "sharding", None)
            if sharding is not None:
                keys = jax.device_put(keys, sharding)
        return keys
    if host.dtype != target.out_dtype:
        _casting.check(record.path, host, target.out_dtype, cast=target.cast)
        host = host.astype(target.out_dtype)
    if like is None:
        return _python_value(kind, host)
    if isinstance(like, (bool, int, float, complex)):
        return type(like)(host[()])
    if isinstance(like, np.generic):
        return host[()]
    if isinstance(like, np.ndarray):
        return host
    sharding = like.sharding if isinstance(like, jax.Array) else getattr(like, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return (host, sharding)


class Placer:
    """Batches host-to-device transfers: one ``jax.device_put`` call per ``flush_bytes``
    (per-leaf calls dominate restores of thousands of small leaves)."""

    def __init__(self, flush_bytes: int):
        self.flush_bytes = flush_bytes
        self.pending: list[tuple[Target, np.ndarray, Any]] = []
        self.nbytes = 0

    def add(self, target: Target, host: np.ndarray, sharding: Any) -> None:
        self.pending.append((target, host, sharding))
        self.nbytes += host.nbytes
        if self.nbytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        # One call per sharding: jax.device_put with one sharding for a whole list
        # skips broadcasting a list of shardings over it (a third of its time for
        # thousands of small leaves).
        groups: dict[Any, list[tuple[Target, np.ndarray]]] = {}
        for target, host, sharding in self.pending:
            groups.setdefault(sharding, []).append((target, host))
        self.pending, self.nbytes = [], 0
        for sharding, items in groups.items():
            try:
                placed = _put(items, sharding)
            except (RuntimeError, TypeError, ValueError) as e:  # jax's: named by its leaf
                raise _unplaceable(items, sharding, e) from e
            for (target, _), array in zip(items, placed, strict=True):
                target.result = array


def _put(items: list[tuple[Target, np.ndarray]], sharding: Any) -> list[jax.Array]:
    if _direct_put and _one_device_memory(sharding):
        return _put_on_one_device([host for _, host in items], sharding)
    if sharding.is_fully_addressable:
        return jax.device_put([host for _, host in items], sharding)
    return [place(host, sharding) for _, host in items]


def _unplaceable(items: list, sharding: Any, error: Exception) -> Exception:
    """The leaf of ``items`` that jax cannot place (a dtype its backend does not hold,
    float6 on CPU), as a StructureError naming it; ``error`` itself when none fails
    alone."""
    for target, host in items:
        try:
            _put([(target, host)], sharding)
        except (RuntimeError, TypeError, ValueError) as e:
            platform = next(iter(sharding.device_set)).platform
            return cannot_place(target.record.path, host.dtype, platform, e)
    return error


def cannot_place(path: str, dtype: Any, platform: str, error: Exception) -> StructureError:
    """Leaf ``path``'s ``dtype`` that jax refused (``error``) to place on ``platform``:
    the one text of every reader (``fop.restore``, ``fop.from_safetensors``)."""
    return StructureError(
        f"leaf {path!r}: jax cannot place a {dtype} array on "
        f"{platform} ({' '.join(str(error).split())[:200]}); read it to the host "
        "instead (a numpy array in like, or like=None)"
    )


def _one_device_memory(sharding: Any) -> bool:
    """Whether ``sharding`` is one device's default memory (not pinned host memory)."""
    return isinstance(sharding, jax.sharding.SingleDeviceSharding) and sharding.memory_kind in (
        None,
        "device",
    )


def _put_on_one_device(hosts: list[np.ndarray], sharding: Any) -> list[jax.Array]:
    """``hosts`` onto the one device of ``sharding``, one transfer each, without
    ``jax.device_put``'s per-array dispatch (its checks, aval updates and broadcasting
    of the target over the list: ~70 us an array, against ~25 us here): the call
    jax's own ``device_put`` makes for a numpy array onto one device
    (``pxla.batched_device_put``), with one abstract value per (shape, dtype).
    The arrays are committed to the device, as ``jax.device_put`` makes them; a dtype
    that jax canonicalizes (float64 without x64) goes through ``jax.device_put``."""
    device = next(iter(sharding.device_set))
    avals: dict[tuple, Any] = {}
    out = []
    for host in hosts:
        key = (host.shape, host.dtype)
        aval = avals.get(key)
        if aval is None:
            # a dtype jax would change (float64 with x64 off): jax.device_put's own way
            same = jax.dtypes.canonicalize_dtype(host.dtype) == host.dtype
            aval = avals[key] = _jax_core.ShapedArray(host.shape, host.dtype) if same else False
        if aval is False:
            out.append(jax.device_put(host, sharding))
        else:
            out.append(_direct_put(aval, sharding, [host], [device], True))
    return out


def place(host: np.ndarray, sharding: Any) -> jax.Array:
    """``host`` (the same on every process) onto ``sharding``, from this process's own
    shards: no collective. ``jax.device_put`` onto devices of other processes checks that
    every process holds the same value, an all-gather the others may never enter (one
    that failed before it, to learn of at the restore's agreement): they would wait in
    it, where no failure is seen (``_base.regions``)."""
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _python_value(kind: str, host: np.ndarray) -> Any:
    if kind == "py_int":
        return int(host[()])
    if kind == "py_float":
        return float(host[()])
    if kind == "py_bool":
        return bool(host[()])
    if kind == "py_complex":
        return complex(host[()])
    if kind == "np_scalar":
        return host[()]
    return host


def sharding_of(target: Target) -> Any:
    like = target.like
    if target.record.kind == "prng_key" or like is None:
        return None
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct)):
        return getattr(like, "sharding", None)
    return None
