"""Reading the stored data of a restore's targets: arrays, shards, batches.

:func:`read_targets` checks the metadata's claims (``claims``), then issues every
read in order: whole chunks of plain local arrays straight from their files
(``_zarr.chunk_files``), anything else through tensorstore, keeping at most the
host-memory budget of reads in flight. Damage is reported per leaf
(CorruptCheckpointError), a checkpoint deleted while read as StepDeletedError, and
environmental failures (EMFILE, EIO, timeouts) as what they are.
Threading: reads are issued from the calling thread to tensorstore's own pool and
the chunk reader's threads; callbacks run on the calling thread.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import math
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from .._base import distributed as _distributed
from .._base import host as _host
from .._errors import CheckpointError, CorruptCheckpointError, StepDeletedError
from .._format import layout as _layout
from .._format.layout import (
    COMMIT_FILE,
    ArrayStorage,
    BatchRecord,
    BatchStorage,
    CheckpointDocument,
    array_dir,
    batch_dir,
)
from .._like import casting as _casting
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunk_files as _chunk_files
from .direct import open_direct, read_slice
from .targets import Placer, Target, finish, sharding_of


def deleted_or(location: Location, error: Exception) -> Exception:
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


class ReadInto:
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
        self.placer = Placer(flush_bytes=min(limit, 256 << 20))
        self.pending: collections.deque = collections.deque()
        self.in_flight = 0

    def submit(self, future, nbytes: int, on_done, on_error) -> None:
        if getattr(future, "deferred", False):  # starts when waited for: holds nothing yet
            nbytes = 0
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
                raise_environmental(e)
                on_error(e)
                continue
            on_done(data)


def raise_environmental(error: Exception) -> None:
    """Raises the OSError ``error`` stands for when it is no proof of damage (EMFILE,
    EIO, EACCES, a timeout, a refused connection: see ``_arrays.environmental``), so
    that no intact checkpoint is reported (and set aside) as damaged."""
    env = _arrays.environmental(error)
    if env is error:
        raise error
    if env is not None:
        raise env from error


def corrupt(paths: list[str], location: Location, error: Exception) -> CorruptCheckpointError:
    shown = ", ".join(repr(p) for p in paths[:20]) + (" ..." if len(paths) > 20 else "")
    noun = "leaf" if len(paths) == 1 else "leaves"
    error = str(error).split(" [tensorstore_spec=", 1)[0]
    return CorruptCheckpointError(
        f"{noun} {shown} in {location}: stored data is damaged or missing ({error})"
    )


def read_targets(location: Location, doc: CheckpointDocument, targets: list, limit: int):
    try:
        _read_targets_inner(location, doc, targets, limit)
    except CorruptCheckpointError as e:
        raise deleted_or(location, e) from None


def _read_targets_inner(location: Location, doc: CheckpointDocument, targets: list, limit: int):
    direct = open_direct(location, doc, targets)
    try:
        _read_targets_with(location, doc, targets, limit, direct)
    finally:
        if direct is not None:
            direct.close()


def read_region(store, target: Target, direct: _chunk_files.ChunkReader | None, region=None):
    """A read of ``region`` (global; None: all) of a stored array: straight from its
    chunk files where they are plain (local, uncompressed) and the region is whole
    chunks, else through tensorstore."""
    record = target.record
    if direct is not None and record.storage.codec is None:
        dtype = _layout.dtype_from_name(record.dtype, path=record.path)
        sub = array_dir(target.index)
        read = direct.read(sub, record.shape, record.storage.chunk_shape, dtype, region)
        if read is not None:
            return read
    return ReadInto(store if region is None else store[region])


def _read_targets_with(location, doc, targets, limit, direct):
    reader = _Reader(limit)
    errors: list[CorruptCheckpointError] = []
    by_batch: dict[str, list[Target]] = collections.defaultdict(list)
    shared: list[tuple[Target, Any]] = []  # (target, its replicated sharding)

    def fail(paths):
        return lambda e: errors.append(corrupt(paths, location, e))

    opening = {}  # every array's zarr.json read at once (version 1)
    packed = doc.format_version == 2
    for target in targets:
        record = target.record
        if isinstance(record.storage, ArrayStorage) and not packed:
            spec = _arrays.leaf_spec(location, target.index, record)
            opening[target.index] = _arrays.open_for_read(spec)
    for target in targets:
        record = target.record
        if record.kind in _layout.NO_DATA_KINDS:
            continue
        if isinstance(record.storage, BatchStorage):
            by_batch[record.storage.batch].append(target)
            continue
        store = None if packed else _opened(opening.pop(target.index), location, [record.path])
        nbytes = record.nbytes
        sharding = sharding_of(target)
        rows = _shared_read_sharding(sharding, record.shape) if SHARE_READS.get() else None
        if rows is not None:  # each process reads 1/P; an all-gather replicates it
            shared.append((target, sharding))
            _read_shards(reader, store, target, rows, fail([record.path]), direct)
        elif sharding is None or sharding.is_fully_replicated or nbytes == 0:

            def done(data, target=target):
                finish(target, data, reader.placer)

            reader.submit(read_region(store, target, direct), nbytes, done, fail([record.path]))
        else:
            _read_shards(reader, store, target, sharding, fail([record.path]), direct)
    for name, members in by_batch.items():
        _read_batch(reader, location, doc.batches[name], members, fail, errors, direct)
    reader.drain(0)
    reader.placer.flush()
    if errors:
        raise deleted_or(location, errors[0])
    for target, sharding in shared:  # collective, in the same order on every process
        target.result = _replicate(sharding)(target.result)


SHARE_READS: contextvars.ContextVar[bool] = contextvars.ContextVar("share_reads", default=False)


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


def open_array(spec: dict[str, Any], location: Location, paths: list[str]):
    """Opens a stored array, checking its ``zarr.json`` agrees with the metadata (shape,
    dtype, chunks, codecs); a mismatch names the leaves."""
    return _opened(_arrays.open_for_read(spec), location, paths)


def _opened(future, location: Location, paths: list[str]):
    try:
        return future.result()
    except ValueError as e:
        raise_environmental(e)
        raise corrupt(paths, location, e) from None


def _read_shards(reader: _Reader, store, target: Target, sharding, on_error, direct) -> None:
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
        reader.submit(read_region(store, target, direct, box_index), nbytes, done_box, on_error)
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

        reader.submit(read_region(store, target, direct, index), nbytes, done, on_error)


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
    paths = [t.record.path for t in members]
    packed = direct is not None and direct.packed
    store = None if packed else open_array(_arrays.batch_spec(location, batch), location, paths)
    needed = sum(t.record.storage.size for t in members)

    def read_each(targets):
        for target in targets:
            off, size = target.record.storage.offset, target.record.storage.size

            def done(data, target=target):
                finish(target, data, reader.placer)

            reader.submit(
                ReadInto(store[off : off + size])
                if store is not None
                else read_slice(direct, batch, off, size),
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
            finish(target, data[off : off + size], reader.placer)

    def failed_all(error):
        # Find which leaves sit in the damaged chunk(s): read them one by one.
        before = len(errors)
        read_each(members)
        reader.drain(0)
        if len(errors) == before:
            errors.append(corrupt([t.record.path for t in members], location, error))
        else:
            bad = [str(e) for e in errors[before:]]
            del errors[before:]
            paths = [t.record.path for t in members if any(repr(t.record.path) in b for b in bad)]
            errors.append(corrupt(paths, location, error))

    if direct is not None and batch.codec is None:
        sub, inner = batch_dir(batch.name), _arrays.batch_inner(batch)
        whole = direct.read_batch(sub, batch.size, int(batch.chunk), inner, dtype)
    else:
        whole = ReadInto(store)
    reader.submit(whole, batch.size * dtype.itemsize, done_all, failed_all)
