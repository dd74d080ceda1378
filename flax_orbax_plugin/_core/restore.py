"""Restoring a pytree, driven by a ``like`` template.

``like`` decides the structure and the form of every leaf:

* ``None`` (the whole tree or one leaf): numpy arrays / Python scalars on the host,
  structure rebuilt from the saved paths as nested dicts and lists;
* a ``jax.Array`` or ``jax.ShapeDtypeStruct`` with a sharding: a jax.Array on that
  sharding; each process reads exactly the regions its devices need, whatever mesh
  or device count the checkpoint was written with;
* a ``jax.ShapeDtypeStruct`` without a sharding: a jax.Array on the default device;
* a numpy array or scalar, a Python scalar: the same kind of value.

A dtype in ``like`` that differs from the saved one is cast, only where no value
changes beyond float rounding (see ``_casting``; ``cast="unsafe"`` opts out). With
``partial=True`` the template may be a subtree; only its leaves are read.

Threading: reads are issued to tensorstore's own thread pool from the calling
thread; the host-memory budget bounds the bytes of reads in flight.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from .._base import distributed as _distributed
from .._base import host as _host
from .._base import tree as _tree
from .._errors import (
    CheckpointError,
    CorruptCheckpointError,
    StepDeletedError,
    StructureError,
)
from .._format import layout as _layout
from .._format import metadata as _metadata
from .._format.documents import read_document
from .._format.layout import (
    COMMIT_FILE,
    METADATA_FILE,
    ArrayStorage,
    BatchRecord,
    BatchStorage,
    CheckpointDocument,
    LeafRecord,
)
from .._like import casting as _casting
from .._like import onto_like as _onto_like
from .._like import transform as _transform
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunk_files as _chunk_files
from . import save as _save

# Reads in flight beyond the restored arrays themselves. Small: reading leaves one
# after another (each with tensorstore's chunk-level parallelism) is as fast as
# reading them all at once on few cores, and keeps peak memory near the result's.
DEFAULT_MEMORY_LIMIT_BYTES = 64 << 20


def metadata(path: Any) -> _metadata.CheckpointMetadata:
    """Leaf paths, shapes, dtypes and shardings of this library's checkpoint at
    ``path``; reads no array data (``_reading.restore.metadata`` adds what a foreign
    checkpoint there is)."""
    location = Location.from_path(path)
    _save.wait_for_pending_save(location)
    return _metadata.to_public(read_document(location), str(location))


# -- targets ------------------------------------------------------------------------


@dataclasses.dataclass
class _Target:
    index: int  # leaf number in the checkpoint
    record: LeafRecord
    like: Any
    dtype: np.dtype | None = None  # saved dtype
    out_dtype: Any = None
    result: Any = None


def _describe(x: Any) -> str:
    if x is None:
        return "None"
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None:
        return f"{type(x).__name__}(shape={tuple(shape)}, dtype={dtype})"
    return type(x).__name__


def _make_target(index: int, record: LeafRecord, like: Any) -> _Target:
    path = record.path
    target = _Target(index, record, like)
    if record.kind in _layout.EMPTY_KINDS:
        return _empty_target(target)
    if record.kind in _layout.TEXT_KINDS:
        return _text_target(target)
    if record.kind == "none":
        if like is not None:
            raise StructureError(
                f"leaf {path!r}: expected {_describe(like)} (from like), "
                f"found None in the checkpoint"
            )
        return target
    target.dtype = _layout.dtype_from_name(record.dtype, path=path)
    saved_shape = record.shape
    if record.kind == "prng_key":
        return target  # shape and dtype checked after wrapping
    if like is None:
        target.out_dtype = target.dtype
        return target
    like_shape, like_dtype = _onto_like.template_of(path, like)
    if jax.dtypes.issubdtype(like_dtype, jax.dtypes.prng_key):
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
    return target


def _text_target(target: _Target) -> _Target:
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


def _empty_target(target: _Target) -> _Target:
    """An empty node ({}, [], EmptyState()): no data; the result is ``like`` itself."""
    like, kind = target.like, target.record.kind
    if like is not None and not _tree.is_empty_node(like):
        raise StructureError(
            f"leaf {target.record.path!r}: expected {_describe(like)} (from like), found an "
            f"empty {'list' if kind == 'empty_list' else 'node'} in the checkpoint"
        )
    target.result = _tree.empty_value(kind) if like is None else like
    return target


def _add_missing_empties(flat: list, records: dict[str, tuple[int, LeafRecord]]) -> None:
    """Empty nodes of ``like`` that a checkpoint does not record (written before empty
    nodes were recorded) hold no data: they are restored as they are in ``like``."""
    for path, keys, leaf in flat:
        if path not in records and _tree.is_empty_node(leaf):
            kind = _tree.empty_kind(leaf)
            records[path] = (-1, LeafRecord(path, tuple(tuple(k) for k in keys), kind))


def _deleted_or(location: Location, error: Exception) -> Exception:
    """``error``, or a StepDeletedError when the checkpoint's commit marker is gone (the
    writer's retention removed it while this process was reading)."""
    try:
        if location.exists(COMMIT_FILE) or location.parent.exists(_layout.MANIFEST_FILE):
            return error
    except (CheckpointError, OSError):  # a foreign marker, or unknown: not a deletion
        return error
    deleted = StepDeletedError(
        f"{location} was deleted while it was being read (a writer's retention policy "
        f"removes old steps; restore a newer step, or keep more): {error}"
    )
    deleted.__cause__ = error
    return deleted


def _finish(target: _Target, host: np.ndarray, placer: _Placer) -> None:
    """Turns host data into the leaf's final form (cast, scalar) in ``target.result``;
    device placement goes through ``placer``."""
    value = _final_value(target, host)
    if isinstance(value, tuple):  # (host, sharding): batched device_put
        placer.add(target, *value)
    else:
        target.result = value


def _final_value(target: _Target, host: np.ndarray) -> Any:
    record, like = target.record, target.like
    kind = record.kind
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
        _casting.check(record.path, host, target.out_dtype)
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


class _Placer:
    """Batches host-to-device transfers: one ``jax.device_put`` call per ``flush_bytes``
    (per-leaf calls dominate restores of thousands of small leaves)."""

    def __init__(self, flush_bytes: int):
        self.flush_bytes = flush_bytes
        self.pending: list[tuple[_Target, np.ndarray, Any]] = []
        self.nbytes = 0

    def add(self, target: _Target, host: np.ndarray, sharding: Any) -> None:
        self.pending.append((target, host, sharding))
        self.nbytes += host.nbytes
        if self.nbytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        targets, hosts, shardings = zip(*self.pending, strict=True)
        self.pending, self.nbytes = [], 0
        for target, array in zip(
            targets, jax.device_put(list(hosts), list(shardings)), strict=True
        ):
            target.result = array


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


def _sharding_of(target: _Target) -> Any:
    like = target.like
    if target.record.kind == "prng_key" or like is None:
        return None
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct)):
        return getattr(like, "sharding", None)
    return None


# -- reading ------------------------------------------------------------------------


class _ReadInto:
    """A read straight into a new numpy array (tensorstore copies chunk by chunk into it,
    without a second whole-array buffer)."""

    def __init__(self, view):
        self.out = _host.empty(view.shape, view.dtype.numpy_dtype)  # adopted by jax on CPU
        self.future = ts.array(self.out, copy=False).write(view)

    def result(self) -> np.ndarray:
        self.future.result()
        return self.out


class _Reader:
    """Issues tensorstore reads in order, keeping at most ``limit`` bytes in flight."""

    def __init__(self, limit: int):
        self.limit = limit
        self.placer = _Placer(flush_bytes=min(limit, 256 << 20))
        self.pending: collections.deque = collections.deque()
        self.in_flight = 0

    def submit(self, future, nbytes: int, on_done, on_error) -> None:
        self.pending.append((future, nbytes, on_done, on_error))
        self.in_flight += nbytes
        self.drain(self.limit)

    def drain(self, to: int = 0) -> None:
        while self.pending and (self.in_flight > to or to == 0):  # zero-byte reads too
            future, nbytes, on_done, on_error = self.pending.popleft()
            self.in_flight -= nbytes
            try:
                data = future.result()
            except Exception as e:  # noqa: BLE001  (tensorstore: ValueError with a status text)
                _raise_environmental(e)
                on_error(e)
                continue
            on_done(data)


def _raise_environmental(error: Exception) -> None:
    """Raises the OSError ``error`` stands for when it is no proof of damage (EMFILE,
    EIO, EACCES, a timeout, a refused connection: see ``_arrays.environmental``), so
    that no intact checkpoint is reported (and set aside) as damaged."""
    env = _arrays.environmental(error)
    if env is error:
        raise error
    if env is not None:
        raise env from error


def _corrupt(paths: list[str], location: Location, error: Exception) -> CorruptCheckpointError:
    shown = ", ".join(repr(p) for p in paths[:20]) + (" ..." if len(paths) > 20 else "")
    noun = "leaf" if len(paths) == 1 else "leaves"
    error = str(error).split(" [tensorstore_spec=", 1)[0]
    return CorruptCheckpointError(
        f"{noun} {shown} in {location}: stored data is damaged or missing ({error})"
    )


def _read_targets(location: Location, doc: CheckpointDocument, targets: list, limit: int):
    try:
        _read_targets_inner(location, doc, targets, limit)
    except CorruptCheckpointError as e:
        raise _deleted_or(location, e) from None


def _read_targets_inner(location: Location, doc: CheckpointDocument, targets: list, limit: int):
    check_claims(location, doc, targets)
    direct = _chunk_files.ChunkReader(location.path) if _chunk_files.usable(location) else None
    try:
        _read_targets_with(location, doc, targets, limit, direct)
    finally:
        if direct is not None:
            direct.close()


def check_claims(location: Location, doc: CheckpointDocument, targets: list) -> None:
    """Checks that the chunk files of every array and batch that ``targets`` read hold
    at least the bytes their metadata claims, before anything sized by a claim is
    allocated (a resealed, checksum-valid ``_METADATA.json`` may claim any shape):
    a CorruptCheckpointError naming the file, the field and what is on disk otherwise.
    Local disks only (object stores list no sizes: a read there is bounded by the
    ``zarr.json`` agreement and tensorstore's own per-chunk checks). One ``stat`` per
    existing chunk file; nothing per claimed element or chunk."""
    if not location.is_local:
        return
    where = f"{location}/{METADATA_FILE}"
    batches: dict[str, list[str]] = collections.defaultdict(list)
    for target in targets:
        record = target.record
        storage = record.storage
        if isinstance(storage, BatchStorage):
            batches[storage.batch].append(record.path)
        if not isinstance(storage, ArrayStorage):
            continue
        itemsize = _layout.dtype_from_name(record.dtype, path=record.path).itemsize
        needed = _chunk_files.array_claim(
            record.shape, storage.chunk_shape, itemsize, compressed=storage.codec is not None
        )
        field = f"leaves[{target.index}] ({record.path!r}).shape"
        _check_claim(location, f"d/{int(target.index)}", needed, where, field, record.shape)
    for name, paths in sorted(batches.items()):
        batch = doc.batches[name]
        itemsize = _layout.dtype_from_name(batch.dtype).itemsize
        needed = _chunk_files.batch_claim(
            batch.size,
            int(batch.chunk),
            _save._batch_inner(batch),
            itemsize,
            compressed=batch.codec is not None,
        )
        shown = ", ".join(repr(p) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")
        field = f"batches[{name!r}].size (holding leaves {shown})"
        _check_claim(location, f"b/{name}", needed, where, field, batch.size)


def _check_claim(location, sub: str, needed, where: str, field: str, claim) -> None:
    files, nbytes = needed
    if files == 0:
        return
    found_files, found_bytes = _chunk_files.stored_files(location.path, sub)
    if found_files < files or found_bytes < nbytes:
        raise CorruptCheckpointError(
            f"{where}: field {field}: {_layout._show(claim)} needs {files} chunk files of "
            f"{nbytes} bytes in all under {location}/{sub}/c, found {found_files} files of "
            f"{found_bytes} bytes (stored data is damaged or missing, or the metadata "
            f"claims more than was stored)"
        )


def _read_region(store, target: _Target, direct: _chunk_files.ChunkReader | None, region=None):
    """A read of ``region`` (global; None: all) of a stored array: straight from its
    chunk files where they are plain (local, uncompressed) and the region is whole
    chunks, else through tensorstore."""
    record = target.record
    if direct is not None and record.storage.codec is None:
        dtype = _layout.dtype_from_name(record.dtype, path=record.path)
        sub = f"d/{int(target.index)}"
        read = direct.read(sub, record.shape, record.storage.chunk_shape, dtype, region)
        if read is not None:
            return read
    return _ReadInto(store if region is None else store[region])


def _read_targets_with(location, doc, targets, limit, direct):
    reader = _Reader(limit)
    errors: list[CorruptCheckpointError] = []
    by_batch: dict[str, list[_Target]] = collections.defaultdict(list)
    shared: list[tuple[_Target, Any]] = []  # (target, its replicated sharding)

    def fail(paths):
        return lambda e: errors.append(_corrupt(paths, location, e))

    opening = {}  # every array's zarr.json read at once
    for target in targets:
        record = target.record
        if isinstance(record.storage, ArrayStorage):
            spec = _save._array_spec(location, target.index, record)
            opening[target.index] = _arrays.open_for_read(spec)
    for target in targets:
        record = target.record
        if record.kind in _layout.NO_DATA_KINDS:
            continue
        if isinstance(record.storage, BatchStorage):
            by_batch[record.storage.batch].append(target)
            continue
        store = _opened(opening.pop(target.index), location, [record.path])
        nbytes = record.nbytes
        sharding = _sharding_of(target)
        rows = _shared_read_sharding(sharding, record.shape) if _SHARE_READS.get() else None
        if rows is not None:  # each process reads 1/P; an all-gather replicates it
            shared.append((target, sharding))
            _read_shards(reader, store, target, rows, fail([record.path]), direct)
        elif sharding is None or sharding.is_fully_replicated or nbytes == 0:

            def done(data, target=target):
                _finish(target, data, reader.placer)

            reader.submit(_read_region(store, target, direct), nbytes, done, fail([record.path]))
        else:
            _read_shards(reader, store, target, sharding, fail([record.path]), direct)
    for name, members in by_batch.items():
        _read_batch(reader, location, doc.batches[name], members, fail, errors, direct)
    reader.drain(0)
    reader.placer.flush()
    if errors:
        raise _deleted_or(location, errors[0])
    for target, sharding in shared:  # collective, in the same order on every process
        target.result = _replicate(sharding)(target.result)


_SHARE_READS: contextvars.ContextVar[bool] = contextvars.ContextVar("share_reads", default=False)


def _shared_read_sharding(sharding: Any, shape: tuple[int, ...]) -> Any:
    """For a leaf replicated over several processes: the sharding that splits its rows
    over every device (each process then reads only its devices' rows), or None where
    that does not apply (one process, not replicated, rows not divisible)."""
    if (
        _distributed.process_count() == 1
        or not isinstance(sharding, jax.sharding.NamedSharding)
        or not sharding.is_fully_replicated
        or not shape
        or shape[0] % sharding.mesh.size
    ):
        return None
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(tuple(sharding.mesh.axis_names))
    )


@functools.lru_cache(maxsize=64)
def _replicate(sharding: Any):
    """An all-gather onto ``sharding`` (jax's collectives: the interconnect, or gloo on
    CPU), as one jitted identity."""
    return jax.jit(lambda x: x, out_shardings=sharding)


def _open(spec: dict[str, Any], location: Location, paths: list[str]):
    """Opens a stored array, checking its ``zarr.json`` agrees with the metadata (shape,
    dtype, chunks, codecs); a mismatch names the leaves."""
    return _opened(_arrays.open_for_read(spec), location, paths)


def _opened(future, location: Location, paths: list[str]):
    try:
        return future.result()
    except ValueError as e:
        _raise_environmental(e)
        raise _corrupt(paths, location, e) from None


def _read_shards(reader: _Reader, store, target: _Target, sharding, on_error, direct) -> None:
    """Reads only the regions this process's devices need; assembles a global jax.Array."""
    shape = target.record.shape
    by_index: dict[tuple, list] = collections.defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) if isinstance(s, slice) else s for s in index)
        by_index[key].append((device, index))
    pieces: list[jax.Array] = []
    remaining = [len(by_index)]
    itemsize = target.dtype.itemsize
    box = _bounding_box(list(by_index), shape, target.record.storage.chunk_shape)
    if box is not None:  # this process's regions tile one box: read it once
        box_index = tuple(slice(lo, hi) for lo, hi in box)

        def done_box(data):
            if data.dtype != target.out_dtype:
                _casting.check(target.record.path, data, target.out_dtype)
                data = data.astype(target.out_dtype)
            for key, devices in by_index.items():
                rel = tuple(
                    slice(lo - blo, hi - blo)
                    for (lo, hi), (blo, _) in zip(_bounds(key, shape), box, strict=True)
                )
                pieces.extend(jax.device_put(data[rel], device) for device, _ in devices)
            target.result = jax.make_array_from_single_device_arrays(shape, sharding, pieces)

        nbytes = math.prod(hi - lo for lo, hi in box) * itemsize
        reader.submit(_read_region(store, target, direct, box_index), nbytes, done_box, on_error)
        return

    for key, devices in by_index.items():
        index = devices[0][1]
        nbytes = math.prod(hi - lo for lo, hi in _bounds(key, shape)) * itemsize

        def done(data, devices=devices):
            if data.dtype != target.out_dtype:
                _casting.check(target.record.path, data, target.out_dtype)
                data = data.astype(target.out_dtype)
            pieces.extend(jax.device_put(data, device) for device, _ in devices)
            remaining[0] -= 1
            if remaining[0] == 0:
                target.result = jax.make_array_from_single_device_arrays(shape, sharding, pieces)

        reader.submit(_read_region(store, target, direct, index), nbytes, done, on_error)


def _bounds(key: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(lo or 0, shape[d] if hi is None else hi) for d, (lo, hi) in enumerate(key)]


def _bounding_box(
    keys: list[tuple], shape: tuple[int, ...], chunk: tuple[int, ...]
) -> list[tuple[int, int]] | None:
    """The box around several regions when a stored chunk straddles two of them and they
    (nearly) fill the box, so one read serves them all and no chunk is read twice.
    Regions that fall on chunk boundaries are read separately, each straight into its
    own buffer (no extra copy)."""
    if len(keys) < 2 or not shape:
        return None
    regions = [_bounds(k, shape) for k in keys]
    aligned = all(
        lo % c == 0 and (hi % c == 0 or hi == n)
        for r in regions
        for (lo, hi), c, n in zip(r, chunk, shape, strict=True)
    )
    if aligned:
        return None
    box = [
        (min(r[d][0] for r in regions), max(r[d][1] for r in regions)) for d in range(len(shape))
    ]
    volume = lambda b: int(np.prod([hi - lo for lo, hi in b], dtype=np.int64))
    needed = sum(volume(r) for r in regions)
    return box if volume(box) <= needed * 1.125 else None


def _read_batch(reader, location, batch: BatchRecord, members, fail, errors, direct) -> None:
    """Reads a batch of small leaves whole when most of it is needed (straight from its
    files where ``direct`` can), else leaf by leaf."""
    dtype = _layout.dtype_from_name(batch.dtype)
    store = _open(_save._batch_spec(location, batch), location, [t.record.path for t in members])
    needed = sum(t.record.storage.size for t in members)

    def read_each(targets):
        for target in targets:
            off, size = target.record.storage.offset, target.record.storage.size

            def done(data, target=target):
                _finish(target, data, reader.placer)

            reader.submit(
                _ReadInto(store[off : off + size]),
                size * dtype.itemsize,
                done,
                fail([target.record.path]),
            )

    if needed * 2 < batch.size:
        read_each(members)
        return

    def done_all(data):
        for target in members:
            off, size = target.record.storage.offset, target.record.storage.size
            _finish(target, data[off : off + size], reader.placer)

    def failed_all(error):
        # Find which leaves sit in the damaged chunk(s): read them one by one.
        before = len(errors)
        read_each(members)
        reader.drain(0)
        if len(errors) == before:
            errors.append(_corrupt([t.record.path for t in members], location, error))
        else:
            bad = [str(e) for e in errors[before:]]
            del errors[before:]
            paths = [t.record.path for t in members if any(repr(t.record.path) in b for b in bad)]
            errors.append(_corrupt(paths, location, error))

    if direct is not None and batch.codec is None:
        sub, inner = f"b/{batch.name}", _save._batch_inner(batch)
        whole = direct.read_batch(sub, batch.size, int(batch.chunk), inner, dtype)
    else:
        whole = _ReadInto(store)
    reader.submit(whole, batch.size * dtype.itemsize, done_all, failed_all)


def restore(
    path: Any,
    like: Any = None,
    *,
    partial: bool = False,
    missing: str = "error",
    transform: Any = None,
    memory_limit_bytes: int | None = None,
    cast: str = "safe",
    share_replicated_reads: bool | None = None,
) -> Any:
    """Restores this library's own checkpoint at ``path`` in the form of ``like``.

    The native reader behind :func:`flax_orbax_plugin.restore` (``_reading.restore``),
    which documents the arguments and errors and adds the fallback to foreign formats;
    internal callers that read only native checkpoints (items of a step, serving,
    export) call this one. Threading as in the module doc.

    Restoring into a changed model (see ``_like.transform``): ``partial=True`` leaves out
    saved leaves ``like`` does not have; ``missing="keep"`` keeps ``like``'s own value
    for a leaf the checkpoint lacks (a ShapeDtypeStruct there raises, naming it);
    ``transform`` maps saved leaf paths to ``like``'s: ``{regex: replacement}``
    applied with ``re.sub`` in order, or a callable ``path -> path | None`` (None
    drops the leaf). Without them every difference is listed in one StructureError.
    """
    opts = _transform.changes(partial=partial, missing=missing, transform=transform)
    location = Location.from_path(path)
    _save.wait_for_pending_save(location)
    limit = memory_limit_bytes or DEFAULT_MEMORY_LIMIT_BYTES
    share = share_replicated_reads
    token = _SHARE_READS.set(_distributed.process_count() > 1 if share is None else bool(share))
    try:
        with _tree.paused_gc(), _casting.policy(cast):
            return _restore(location, like, opts, limit)
    finally:
        _SHARE_READS.reset(token)


def _dropped_or_same(opts: _transform.Changes, path: str) -> bool:
    """With ``like=None`` a transform may only drop leaves (False): there is no
    structure to place a renamed one in."""
    new = opts.rename(path)
    if new is not None and new != path:
        raise ValueError(
            f"transform renames the saved leaf {path!r} to {new!r}, which needs like (the "
            f"tree to place it in); with like=None a transform may only drop leaves (None)"
        )
    return new is not None


def _restore(location: Location, like: Any, opts: _transform.Changes, limit: int) -> Any:
    doc = read_document(location)
    location.check_no_links()  # tensorstore's file driver would follow them
    records = {rec.path: (i, rec) for i, rec in enumerate(doc.leaves)}
    if like is None:
        leaves = list(enumerate(doc.leaves))
        if opts.transform is not None:
            leaves = [(i, rec) for i, rec in leaves if _dropped_or_same(opts, rec.path)]
        targets = [_make_target(i, rec, None) for i, rec in leaves]
        _read_targets(location, doc, targets, limit)
        items = [(list(t.record.keys), t.result) for t in targets]
        return _tree.rebuild(items)
    flat, treedef = _tree.flatten(like)
    records = _transform.rename_records(records, opts, str(location))
    _add_missing_empties(flat, records)
    plan = _transform.match(
        flat, records, opts, where=str(location), make=_make_target, empty_kinds=_layout.EMPTY_KINDS
    )
    targets = [t for t in plan if t is not _transform.KEEP]
    _read_targets(location, doc, targets, limit)
    results = [
        leaf if t is _transform.KEEP else t.result
        for t, (_, _, leaf) in zip(plan, flat, strict=True)
    ]
    return _tree.unflatten(treedef, results)
