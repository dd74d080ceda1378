"""Checkpointables: named, separately restorable pieces of a training state.

A checkpoint step is a directory holding one sub-directory per checkpointable
(``params/``, ``opt_state/``, ``data_iterator/``, ``extras/`` ...). Each piece is
written and read by a :class:`Checkpointable`, a two-method protocol:

``directory`` is a :class:`flax_orbax_plugin._storage.location.Location` (a local
directory or a prefix on an object store); ``request`` is the step's
:class:`~flax_orbax_plugin.SaveRequest` or :class:`~flax_orbax_plugin.ReadRequest`
(frozen: a host's own directory ``own_copy``, its time ``created_at``, the host-memory
budget, a changed model's ``changes``...), the same the built-ins get; a checkpointable
uses the fields it needs. One that sets ``incremental = True`` gets
``request.reuse`` (the previous step's same item) when the manager saves
incrementally. ``request.region`` is the manager operation's collective region
(``_base.regions``), which the built-ins hand down; one that calls ``fop.save`` or
``fop.restore`` itself makes a collective operation of its own: that call draws its
own region (this process's n-th collective operation, so the same on every process
that makes it), inside the manager's.

* ``save(directory, value, request) -> Pending`` runs the *blocking phase* on the calling
  (training) thread: it snapshots ``value`` (device-to-host copies, iterator
  state, JSON encoding) so the caller may mutate or donate it as soon as ``save``
  returns. The returned :class:`Pending` finishes the write; the manager calls
  ``Pending.wait()`` from its background thread, on every process. ``directory``
  (inside the step's staging directory) does not exist yet when ``save`` is called;
  the checkpointable creates it. ``wait()`` returns a :class:`Written` (array bytes,
  and the sha256 of each JSON file it wrote, which the step manifest records and
  restore checks) or None. It commits nothing: the step commits once, after every
  item of every process is durable (the manager makes the staging directory durable
  with one sync).
* ``restore(directory, like, request) -> value`` reads the piece back. ``like`` is the
  abstract or concrete value the caller wants (pytree of arrays or
  ``jax.ShapeDtypeStruct``, an iterator to set the state of, an int, ...) or None.

Built-ins (:func:`checkpointable_for`): ``params``, ``opt_state``, ``rng`` and any other
name are pytrees written through the tensorstore core; ``step`` a JSON integer; ``extras``
a JSON value; ``data_iterator`` the JSON state of an iterator with ``get_state()`` and
``set_state()`` (grain's) or ``state_dict()`` and ``load_state_dict()``, per process.

The older two-argument protocol (no request) works for one release, with a
DeprecationWarning naming the class (:func:`checkpointable_for`). Nothing here ever
unpickles: every non-array file is JSON.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from .._base.env import outside_stacklevel
from .._core import formats as _formats
from .._core import restore as _restore
from .._core import save as _save
from .._core.commit import Written
from .._core.formats import ReadRequest, SaveRequest
from .._errors import CheckpointError, CorruptCheckpointError
from .._format import layout as _layout
from .._format import steps as _steps
from .._state.iterators import iterator_state, set_iterator_state
from .._storage.location import Location
from . import iterator_positions as _positions
from .json_items import encode_json, from_json, read_json, to_json, write_json

__all__ = [
    "Checkpointable",
    "Pending",
    "Written",
    "PytreeCheckpointable",
    "JsonCheckpointable",
    "StepCheckpointable",
    "DataIteratorCheckpointable",
    "checkpointable_for",
    "kind_of",
    "BUILTIN_CHECKPOINTABLES",
    "ReadRequest",
    "SaveRequest",
]

_SAVE = SaveRequest()  # what a built-in called without a request does
_READ = ReadRequest()

JSON_FILE = _layout.JSON_VALUE_FILE
# Kinds of an item that is a copy of another (fop.HFShards): read only when named.
COPY_KINDS = ("hf_safetensors",)


def with_copy_item(items: dict[str, Any], copy: Any, step: int) -> dict[str, Any]:
    """``items`` and, last, item ``copy.name`` holding the value of item ``copy.item``
    (an ``fop.HFShards``: its checkpointable writes the copy)."""
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

    def __init__(self, fn: Callable[[], Any] | None = None, digest: str = ""):
        self._fn = fn
        self._result: Any = None
        self.digest = digest  # of the saved structure, compared across processes
        self.snap: Any = None  # a pytree item's snapshot (see PytreeCheckpointable.save)

    def wait(self) -> Any:
        if self._fn is not None:
            fn, self._fn = self._fn, None
            self._result = fn()
        return self._result


def _process_index() -> int:
    return jax.process_index()


# ----------------------------------------------------------------------------- built-ins


class PytreeCheckpointable:
    """A pytree of arrays written through the tensorstore core (``fop.save_async``).

    ``restore`` hands ``like`` to the core's restore: arrays or ShapeDtypeStructs
    (with ``.sharding`` to restore onto it), or None for numpy on the host.
    ``compression`` / ``format_version``: this item's own (None: the request's).
    """

    kind = "pytree"
    incremental = True  # takes request.reuse

    def __init__(self, *, compression: str | None = None, format_version: int | None = None):
        self.compression = _layout.check_codec(compression)
        if format_version is not None:
            format_version = _formats.check_version(format_version)
        self.format_version = format_version

    def save(self, directory: Location, value: Any, request: SaveRequest = _SAVE) -> Pending:
        """The snapshot now, the write when waited on, as ``request`` says (reuse,
        buffers, budget, a host's own directory and its time); this item's compression
        and format version, where it has them, replace the request's."""
        own: dict[str, Any] = {}
        if self.compression is not None:
            own["compression"] = self.compression
        if self.format_version is not None:
            own["format_version"] = self.format_version
        snap = _save.snapshot(value, request.replace(**own) if own else request)
        done = _Done(lambda: snap.write(directory, durable=False), snap.digest)
        done.snap = snap  # the manager waits for its data under a budget (write_first)
        return done

    def pool_sizes(self, like: Any, request: SaveRequest = _SAVE) -> list[int]:
        """The pooled buffers' sizes one :meth:`save` of a value like ``like`` takes."""
        return _save.pool_sizes(like, request)

    def restore(self, directory: Location, like: Any, request: ReadRequest = _READ) -> Any:
        """The core's restore as ``request`` says: a changed model's ``changes``; a
        host's own directory (``own_copy``): every process reads what it needs itself,
        no collective (a process whose read fails never leaves the others waiting)."""
        return _restore.restore_with(directory, like, request)


class JsonCheckpointable:
    """A small JSON value, written by the primary process only (``extras``; by every
    process into each host's own directory)."""

    kind = "json"

    def _encode(self, value: Any) -> Any:
        return to_json(value, "extras")

    def _decode(self, data: Any, like: Any) -> Any:
        return from_json(data)

    def save(self, directory: Location, value: Any, request: SaveRequest = _SAVE) -> Pending:
        # encoded now, on the caller's thread: refused before the step is committed
        data = encode_json(self._encode(value), f"{directory}/{JSON_FILE}")
        primary = _process_index() == 0 or request.own_copy

        def write() -> Written:
            return write_json(directory, JSON_FILE, data) if primary else Written()

        return _Done(write)

    def restore(self, directory: Location, like: Any, request: ReadRequest = _READ) -> Any:
        return self._decode(read_json(directory, JSON_FILE), like)


class StepCheckpointable(JsonCheckpointable):
    """The training step as a JSON integer; restored with the type of ``like``.

    ``like`` may be an int, a numpy/jax scalar array or a ShapeDtypeStruct (the
    restored value then has that dtype and, if it has one, that sharding).
    """

    kind = "step"

    def _encode(self, value: Any) -> Any:
        arr = np.asarray(value)
        if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"step: expected an integer scalar, found {value!r}")
        return int(arr)

    def _decode(self, data: Any, like: Any) -> Any:
        if not isinstance(data, int) or isinstance(data, bool):
            raise CorruptCheckpointError(f"step: expected an integer, found {data!r}")
        return cast_scalar_like(data, like)


def cast_scalar_like(value: int, like: Any) -> Any:
    """Return ``value`` as the same kind of scalar as ``like`` (int, numpy, jax)."""
    if like is None or isinstance(like, int):
        return int(value)
    dtype = getattr(like, "dtype", None)
    if isinstance(like, np.ndarray | np.generic):
        return np.asarray(value, dtype=dtype)
    sharding = getattr(like, "sharding", None)
    out = jnp.asarray(value, dtype=dtype)
    if sharding is not None:
        out = jax.device_put(out, sharding)
    return out


class DataIteratorCheckpointable:
    """The position of a data iterator, one JSON file per process.

    ``save`` calls ``get_state()`` (or ``state_dict()``) on the caller's thread, so
    the state is the one at the moment of the call. Bytes states (grain's
    DataLoader) are stored base64-encoded. ``restore(directory, like=iterator)``
    calls ``set_state`` on that iterator and returns it; with ``like=None`` it
    returns the decoded state of this process.
    """

    kind = "data_iterator"

    @staticmethod
    def filename(process_index: int) -> str:
        return _layout.iterator_state_file(process_index)

    def save(self, directory: Location, value: Any, request: SaveRequest = _SAVE) -> Pending:
        raw = iterator_state(value)
        state = to_json(raw, "data_iterator")
        name = self.filename(_process_index())
        record = {"state": state, **_positions.position_record(value, raw)}
        data = encode_json(record, f"{directory}/{name}")

        def write() -> Written:
            return write_json(directory, name, data)

        return _Done(write)

    def restore(self, directory: Location, like: Any, request: ReadRequest = _READ) -> Any:
        manifest = _steps.manifest_for_item(directory)
        if manifest is not None and manifest.process_count != jax.process_count():
            # another process count: only a global position carries over
            read = self._reader(directory)
            return _positions.restore_across_counts(directory, like, manifest, read=read)
        state = from_json(self._read(directory, _process_index())["state"])
        if like is None:
            return state
        set_iterator_state(like, state)
        return like

    def _reader(self, directory: Location) -> Callable[[int], dict[str, Any]]:
        return lambda process_index: self._read(directory, process_index)

    def _read(self, directory: Location, process_index: int) -> dict[str, Any]:
        name = self.filename(process_index)
        data = read_json(directory, name)
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


def kind_of(checkpointable: Any) -> str:
    """The kind a step's manifest records for ``checkpointable``'s item, and that a
    restore compares: its ``kind`` (``"custom"`` for a class without one)."""
    return getattr(checkpointable, "kind", "custom")


def checkpointable_for(
    name: str, overrides: Mapping[str, Checkpointable] | None = None
) -> Checkpointable:
    """The checkpointable that handles item ``name``: an override, a built-in, or a pytree.
    An override of the older two-argument protocol comes back adapted (see the module
    docstring)."""
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
    """``checkpointable``, or for one of the older two-argument protocol an adapter
    that calls it without the request (DeprecationWarning naming its class)."""
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
    """At a manager's first save: warns (once) of each item that ``checkpointables=`` or
    ``compression=`` names (``named``) but the save does not hold (a misspelt
    ``compression={"param": ...}`` did nothing, without a word). Returns the empty
    set (nothing is looked at again)."""
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
