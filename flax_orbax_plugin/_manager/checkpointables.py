"""Checkpointables: the protocol and the built-ins (pytrees, JSON items, data-iterator states).
``save`` runs on the training thread, ``Pending.wait`` on the manager's background thread
(every process), ``restore`` on the caller's.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.checkpointables``.
"""

from __future__ import annotations

import base64
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from .._base.shown import outside_stacklevel
from .._core import formats as _formats
from .._core import pool_sizes as _pool_sizes
from .._core import restore as _restore
from .._core import save as _save
from .._core.formats import SaveRequest, Written
from .._core.reads import ReadRequest
from .._errors import CheckpointError, CorruptCheckpointError, StructureError
from .._format import layout as _layout
from .._state import iterators as _iterators
from .._state.iterators import iterator_state, set_iterator_state
from .._storage import local_files as _local_files
from .._storage.location import Location


def to_json(value: Any, where: str, depth: int = 0) -> Any:
    """``value`` as JSON data (bytes and non-finite floats tagged); refused naming ``where``."""
    if depth > _local_files.JSON_ITEM.max_depth:
        raise StructureError(
            f"{where}: nested more than {_local_files.JSON_ITEM.max_depth} levels deep, more "
            f"than a reader accepts in a JSON item"
        )
    if isinstance(value, str):
        return value if value.isascii() else _utf8(value, where)
    if value is None or isinstance(value, int):  # bool too
        return value
    if isinstance(value, float):  # NaN and infinities are not JSON: tagged, exactly
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, np.generic) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        _check_array(value, where)
        arr = np.asarray(value)
        if arr.ndim == 0:
            return to_json(arr.item(), where, depth)
        return to_json(arr.tolist(), where, depth)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: JSON keys must be str, found {k!r}")
            if not k.isascii():
                _utf8(k, f"{where}: the key {k!r}")
            if k in ("__bytes__", "__float__"):
                raise ValueError(f"{where}: the key {k!r} is reserved")
            out[k] = to_json(v, f"{where}/{k}", depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [to_json(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise TypeError(
        f"{where}: cannot store a {type(value).__name__} as JSON; extras and iterator "
        "states must be JSON values (dict, list, str, int, float, bool, None, bytes)"
    )


def _check_array(value: Any, where: str) -> None:
    """A deleted array or PRNG key, refused naming ``where`` (``np.asarray`` names no item)."""
    if not isinstance(value, jax.Array):
        return
    if value.is_deleted():
        raise StructureError(
            f"{where}: expected a live array, found one that was deleted (donated to a "
            f"jitted step, or .delete()d): store its value before the step donates it"
        )
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        raise StructureError(
            f"{where}: a PRNG key cannot be stored as JSON; keep it in the saved state "
            f"(state['rng'], restored as a key), or store jax.random.key_data(key)"
        )


def _utf8(text: str, where: str) -> str:
    """``text`` when UTF-8 encodes it; StructureError naming ``where`` otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StructureError(
            f"{where}: text that UTF-8 cannot encode: {e.reason} ({text[e.start : e.end]!r} "
            f"at character {e.start}); JSON items hold UTF-8 text only"
        ) from None
    return text


def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        if set(value) == {"__float__"} and value["__float__"] in ("nan", "inf", "-inf"):
            return float(value["__float__"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def encode_json(value: Any, where: str) -> bytes:
    """The bytes of a JSON item, within the reader's limits (else StructureError)."""
    return _local_files.encode(value, where, _local_files.JSON_ITEM, sort_keys=True)


def write_json(directory: Location, name: str, data: bytes) -> Written:
    """Writes ``data`` (made durable by the step's sync); returns its checksum."""
    directory.write_bytes(name, data, durable=False)
    return Written(0, {name: _layout.sha256(data)})


def saved_position(data: Any, where: str) -> int | None:
    """The global position recorded in a process's iterator file (None: none)."""
    if not isinstance(data, dict) or _iterators.GLOBAL_POSITION_KEY not in data:
        return None
    value = data[_iterators.GLOBAL_POSITION_KEY]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CorruptCheckpointError(
            f"{where}: 'global_position' must be a non-negative int, found {value!r}"
        )
    return value


def position_across_counts(
    directory: Any,
    like: Any,
    *,
    saved: int,
    restoring: int,
    process: int,
    read: Callable[[int], Any],
) -> int:
    """The global position ``restoring`` processes continue from what ``saved`` ones saved."""
    head = (
        f"{directory}: the data iterator states were saved by {saved} process(es) but "
        f"{restoring} are restoring"
    )
    advice = (
        f"Restore without the data_iterator item and re-seed the pipeline, or use an "
        f"iterator whose state can be re-sharded: {_iterators.describe()}"
    )
    names = [0] if process == 0 or process >= saved else [0, process]
    positions = {i: saved_position(read(i), f"{directory}/process_{i}.json") for i in names}
    if any(p is None for p in positions.values()):
        raise StructureError(
            f"{head}; each process's position is its own (the saved iterator declared "
            f"no global position). {advice}"
        )
    if len(set(positions.values())) > 1:
        found = ", ".join(f"process {i}: {p}" for i, p in positions.items())
        raise StructureError(
            f"{head}; the saved global positions differ ({found}): the processes had not "
            f"drawn the same number of global batches, so no one position continues them all"
        )
    if like is not None and not _iterators.can_set(like):
        raise StructureError(
            f"{head}; the step holds a global data position but the iterator given "
            f"(a {type(like).__name__}) has no set_global_position() to continue from it. "
            f"{advice}"
        )
    return positions[0]


_SAVE = SaveRequest()  # what a built-in called without a request does
_READ = ReadRequest()

JSON_FILE = _layout.JSON_VALUE_FILE

# Kinds of an item that is a copy of another (fop.HFShards): read only when named.
COPY_KINDS = ("hf_safetensors",)


def with_copy_item(items: dict[str, Any], copy: Any, step: int) -> dict[str, Any]:
    """``items`` and, last, item ``copy.name`` holding ``copy.item``'s value (HFShards)."""
    if copy.item not in items:
        raise CheckpointError(
            f"hf_shards: step {step} has no item {copy.item!r} to write as Hugging Face "
            f"shards (items: {sorted(items)}); give HFShards(item=) the item holding the params"
        )
    if copy.name in items:
        raise ValueError(
            f"hf_shards: the state has an item {copy.name!r}, the name of the shards' item; "
            f"give HFShards(name=) another name"
        )
    return {**items, copy.name: items[copy.item]}


@runtime_checkable
class Pending(Protocol):
    """The unfinished, background part of a checkpointable's save."""

    def wait(self) -> Written | None:
        """Block until the piece is written; re-raise any write error."""


@runtime_checkable
class Checkpointable(Protocol):
    """Writes and reads one named piece of a training state.

    ``kind`` is a short string recorded in the step's JSON manifest; ``request`` the
    step's modes (see the module docstring).
    Threading: ``save`` is called on the training thread, ``Pending.wait`` on the
    manager's background thread, ``restore`` on the caller's thread.
    """

    kind: str

    def save(self, directory: Location, value: Any, request: SaveRequest) -> Pending: ...

    def restore(self, directory: Location, like: Any, request: ReadRequest) -> Any: ...


class _Done:
    """A Pending whose work runs, once, when waited on (or is already done)."""

    def __init__(self, fn: Callable[[], Any] | None = None, digest: str = "", snap: Any = None):
        self._fn = fn
        self._result: Any = None
        self.digest = digest  # of the saved structure, compared across processes
        self.snap = snap  # a pytree item's snapshot (see PytreeCheckpointable.save)

    def wait(self) -> Any:
        if self._fn is not None:
            fn, self._fn = self._fn, None
            self._result = fn()
        return self._result


class PytreeCheckpointable:
    """A pytree of arrays through the core (its own compression, format_version or None)."""

    kind = "pytree"
    incremental = True  # takes request.reuse

    def __init__(self, *, compression: str | None = None, format_version: int | None = None):
        self.compression = _layout.check_codec(compression)
        if format_version is not None:
            format_version = _formats.check_version(format_version)
        self.format_version = format_version

    def save(self, directory: Location, value: Any, request: SaveRequest = _SAVE) -> Pending:
        """The snapshot now, the write when waited on."""
        own: dict[str, Any] = {}
        if self.compression is not None:
            own["compression"] = self.compression
        if self.format_version is not None:
            own["format_version"] = self.format_version
        snap = _save.snapshot(value, request.replace(**own) if own else request)
        return _Done(lambda: snap.write(directory, durable=False), snap.digest, snap)

    def pool_sizes(self, like: Any, request: SaveRequest = _SAVE) -> list[int]:
        """The pooled buffers' sizes one :meth:`save` of a value like ``like`` takes."""
        return _pool_sizes.pool_sizes(like, request)

    def restore(self, directory: Location, like: Any, request: ReadRequest = _READ) -> Any:
        return _restore.restore_with(directory, like, request)


class JsonCheckpointable:
    """A small JSON value, written by the primary (by every process, per-host directories)."""

    kind = "json"

    def _encode(self, value: Any) -> Any:
        return to_json(value, "extras")

    def _decode(self, data: Any, like: Any) -> Any:
        return from_json(data)

    def save(self, directory: Location, value: Any, request: SaveRequest = _SAVE) -> Pending:
        # encoded now, on the caller's thread: refused before the step is committed
        data = encode_json(self._encode(value), f"{directory}/{JSON_FILE}")
        primary = jax.process_index() == 0 or request.own_copy
        return _Done(
            functools.partial(write_json, directory, JSON_FILE, data) if primary else Written
        )

    def restore(self, directory: Location, like: Any, request: ReadRequest = _READ) -> Any:
        return self._decode(_layout.read_item_json(directory, JSON_FILE), like)


class StepCheckpointable(JsonCheckpointable):
    """The training step as a JSON int, restored as the kind of ``like`` (int, numpy, jax)."""

    kind = "step"

    def _encode(self, value: Any) -> Any:
        arr = np.asarray(value)
        if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"step: expected an integer scalar, found {value!r}")
        return int(arr)

    def _decode(self, data: Any, like: Any) -> Any:
        if not isinstance(data, int) or isinstance(data, bool):
            raise CorruptCheckpointError(f"step: expected an integer, found {data!r}")
        if like is None or isinstance(like, int):  # the kind of scalar like is
            return int(data)
        dtype = getattr(like, "dtype", None)
        if isinstance(like, np.ndarray | np.generic):
            return np.asarray(data, dtype=dtype)
        out = jnp.asarray(data, dtype=dtype)
        sharding = getattr(like, "sharding", None)
        return out if sharding is None else jax.device_put(out, sharding)


class DataIteratorCheckpointable:
    """The position of a data iterator, one JSON file per process, set on ``like``."""

    kind = "data_iterator"

    def save(self, directory: Location, value: Any, request: SaveRequest = _SAVE) -> Pending:
        raw = iterator_state(value)
        state = to_json(raw, "data_iterator")
        name = _layout.iterator_state_file(jax.process_index())
        record = {"state": state}
        position = _iterators.global_position(value, raw)  # where it declares one
        if position is not None:
            record[_iterators.GLOBAL_POSITION_KEY] = position
        data = encode_json(record, f"{directory}/{name}")
        return _Done(functools.partial(write_json, directory, name, data))

    def restore(self, directory: Location, like: Any, request: ReadRequest = _READ) -> Any:
        manifest = _layout.manifest_for_item(directory)
        if manifest is not None and manifest.process_count != jax.process_count():
            # another process count: only a global position carries over
            read = functools.partial(self._read, directory)
            at = position_across_counts(
                directory,
                like,
                saved=manifest.process_count,
                restoring=jax.process_count(),
                process=jax.process_index(),
                read=read,
            )
            if like is None:
                return from_json(read(0)["state"])
            _iterators.set_global_position(like, at)
            return like
        state = from_json(self._read(directory, jax.process_index())["state"])
        if like is None:
            return state
        set_iterator_state(like, state)
        return like

    def _read(self, directory: Location, process_index: int) -> dict[str, Any]:
        name = _layout.iterator_state_file(process_index)
        data = _layout.read_item_json(directory, name)
        if not isinstance(data, dict) or "state" not in data:
            raise CorruptCheckpointError(f"{directory}/{name}: expected an object with 'state'")
        return data


BUILTIN_CHECKPOINTABLES: Mapping[str, Checkpointable] = {
    "params": PytreeCheckpointable(),
    "opt_state": PytreeCheckpointable(),
    "rng": PytreeCheckpointable(),
    "step": StepCheckpointable(),
    "extras": JsonCheckpointable(),
    "data_iterator": DataIteratorCheckpointable(),
}

_DEFAULT = PytreeCheckpointable()


def check_item_name(name: Any, option: str = "", error: type = StructureError) -> str:
    """``name`` if it is a safe checkpointable name (one given in ``option``), else ``error``."""
    if not _layout.is_safe_name(name):
        what = f"item name {name!r} in {option}" if option else f"checkpointable name {name!r}"
        raise error(
            f"invalid {what}: use letters, digits, '_', '-', '.' and do not start with '_' or '.'"
        )
    return name


def kind_of(checkpointable: Any) -> str:
    """The kind a step's manifest records for ``checkpointable`` (``"custom"``: none)."""
    return getattr(checkpointable, "kind", "custom")


def checkpointable_for(
    name: str, overrides: Mapping[str, Checkpointable] | None = None
) -> Checkpointable:
    """The checkpointable of item ``name``: an override, a built-in, or a pytree."""
    if overrides and name in overrides:
        return with_requests(overrides[name])
    return BUILTIN_CHECKPOINTABLES.get(name, _DEFAULT)


def _takes_request(method: Any) -> bool:
    """Whether ``method`` can be called as ``method(directory, value, request)``."""
    try:
        inspect.signature(method).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): assume the protocol
        return True
    return True


class _TwoArgument:
    """A checkpointable of the two-argument protocol, called without the request."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.kind = kind_of(inner)

    def save(self, directory: Location, value: Any, request: SaveRequest = _SAVE) -> Pending:
        return self.inner.save(directory, value)

    def restore(self, directory: Location, like: Any, request: ReadRequest = _READ) -> Any:
        return self.inner.restore(directory, like)


def with_requests(checkpointable: Any) -> Checkpointable:
    """``checkpointable``, or an adapter for the two-argument protocol (DeprecationWarning)."""
    if _takes_request(checkpointable.save) and _takes_request(checkpointable.restore):
        return checkpointable
    warnings.warn(
        f"checkpointable {type(checkpointable).__name__}: save(directory, value) and "
        f"restore(directory, like) without the request are deprecated; take a third "
        f"argument, request (fop.SaveRequest / fop.ReadRequest)",
        DeprecationWarning,
        stacklevel=outside_stacklevel(),
    )
    return _TwoArgument(checkpointable)


def warn_unheld(named: set[str], items: Mapping[str, Any]) -> set[str]:
    """Warns of each item ``named`` that a first save does not hold; returns the empty set."""
    unheld = sorted(named - set(items))
    if unheld:
        warnings.warn(
            f"checkpointables=/compression= name the item(s) {', '.join(map(repr, unheld))}, "
            f"which this save does not hold (its items: {', '.join(sorted(items))}): they "
            f"do nothing until a save holds an item of that name (check the spelling)",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    return set()
