"""One process's data of a save: its host copies (blocking phase, the saving thread),
then version 2's files and both formats' bounded writes (background phase).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.host_snapshot``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import env as _env
from .._base import host as _host
from .._base.host_memory import BufferPool
from .._errors import CheckpointError
from .._format import layout as _layout
from .._format.layout import ArrayStorage, BatchRecord, BatchStorage, array_dir, batch_dir, sha256
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunks as _chunks
from .._zarr import packed_writer as _packed_writer
from .._zarr import subbyte as _subbyte
from . import device_copy as _device_copy
from .handle import raise_if_cancelled


@dataclasses.dataclass(frozen=True)
class Staging:
    """How a save staged its accelerator arrays, and for a fallback ``note``: why."""

    kind: str = "none"
    note: str = ""

    def __str__(self) -> str:
        return f"{self.kind} ({self.note})" if self.note else self.kind


def on_device(data: Any) -> bool:
    if not isinstance(data, jax.Array):
        return False
    return _device_copy.CPU_AS_DEVICE or next(iter(data.devices())).platform != "cpu"


def materialize(data: Any) -> Any:
    """Host bytes of ``data`` (a :class:`Deferred` is copied, or waited for, here)."""
    if isinstance(data, _device_copy.OnDevice):
        return _device_copy.fetch(data.array, data.part)
    if isinstance(data, _device_copy.Deferred):
        return np.asarray(data.array)
    return data


def materialize_all(leaves: list) -> None:
    for leaf in leaves:
        writes = getattr(leaf, "writes", None)
        if writes:
            leaf.writes = [(rows, materialize(data)) for rows, data in writes]


def pieces(
    rows: tuple[slice, ...], length: int, chunk_rows: int, row_bytes: int, most: int
) -> list:
    """``rows`` cut into regions of whole chunk rows of at most ``most`` bytes (or one row)."""
    if not rows or row_bytes <= 0:
        return [rows]
    start = rows[0].start or 0
    stop = length if rows[0].stop is None else rows[0].stop
    step = max(1, most // (row_bytes * chunk_rows)) * chunk_rows
    if stop - start <= step:
        return [rows]
    return [(slice(lo, min(lo + step, stop)),) + tuple(rows[1:]) for lo in range(start, stop, step)]


def take_small(leaves: list, batches: dict[str, BatchRecord], pool, own_copy: bool = False):
    """The small leaves' batches this process writes, read before any large transfer."""
    me, pooled, keep, writers, owned = _owned(leaves, batches, pool, own_copy, small=True)
    for _, source, _ in owned:
        if on_device(source):
            source.copy_to_host_async()
    batch_data: dict[str, Any] = {}
    ends: dict[str, int] = {}  # end of the last leaf written into each batch
    pieces: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, batch in batches.items():
        if writers[name] == me:
            dtype = _layout.dtype_from_name(batch.dtype)
            if pool is None:
                pieces[name] = []
            else:
                batch_data[name] = keep(pool.empty((batch.size,), dtype))
            ends[name] = 0
    for leaf, source, _ in owned:
        _copy_small(leaf.record.storage, source, batch_data, pieces, ends, pool)
        leaf.value = None  # the snapshot is all the background phase needs
    for name, end in ends.items():
        if name in pieces:
            batch = batches[name]
            dtype = _layout.dtype_from_name(batch.dtype)
            batch_data[name] = _packed_writer.Gathered(pieces[name], dtype, batch.size)
        else:
            batch_data[name][end:] = 0
    return batch_data, pooled


def take_regions(leaves: list, batches: dict, pool, own_copy: bool, budget, device_kind: str):
    """This process's regions of arrays of their own, into ``writes``: (pooled, waits)."""
    _, pooled, keep, _, owned = _owned(leaves, batches, pool, own_copy, small=False)
    later: list[tuple[np.ndarray, np.ndarray]] = []  # pooled copies, made all at once
    streamed = budget is not None
    kind = "streamed" if streamed else device_kind
    views_held = False
    for leaf, source, rows in owned:
        summed = _summed(leaf)
        for part in _pieces(leaf, source, rows, budget):
            data = _copy_region(source, part, pool, keep, later, kind, summed)
            views_held |= streamed and isinstance(data, np.ndarray)
            leaf.writes.append((part, data))
    if kind == "host":  # every transfer started: read before a donation deletes them
        materialize_all(leaves)
    _host.copy_all(later)  # on a few threads: the training thread waits for them anyway
    later.clear()  # its views of the state would stop the next step's donation
    for leaf in leaves:
        if not _is_small(leaf):
            leaf.value = None  # the snapshot is all the background phase needs
    return pooled, views_held


def _owned(leaves: list, batches: dict, pool, own_copy: bool, *, small: bool):
    """(me, pooled buffers, ``keep``, the batches' writers, the regions this writes)."""
    me = _distributed.process_index()
    pooled: list[np.ndarray] = []

    def keep(buffer: np.ndarray) -> np.ndarray:
        if pool is not None:  # given back after the write
            pooled.append(buffer)
        return buffer

    writers = batch_writers(leaves, batches, me, own_copy)
    owned = [o for o in owned_regions(leaves, writers, me, own_copy) if _is_small(o[0]) == small]
    return me, pooled, keep, writers, owned


def _is_small(leaf) -> bool:
    return isinstance(leaf.record.storage, BatchStorage)


# Chunks checksummed as copied into the pool with the C kernel only (onepass_kernel.json).
ONE_PASS = _chunks.has_kernel()


def _summed(leaf):
    """(shape, chunk shape, crcs) for a copy that checksums its chunks, else None."""
    storage = leaf.record.storage
    if not ONE_PASS or storage.codec is not None or _chunks.is_packed(leaf.record):
        return None
    return leaf.record.shape, storage.chunk_shape, leaf.crcs


def _pieces(leaf, source, rows, budget: int | None) -> list:
    """``[rows]``; with a ``budget``, a device region in pieces of a quarter of it."""
    if budget is None or not isinstance(source, tuple) or not on_device(source[0]):
        return [rows]
    data = source[0]
    row_bytes = math.prod(data.shape[1:]) * np.dtype(data.dtype).itemsize
    chunk_rows = leaf.record.storage.chunk_shape[0] if data.ndim else 1
    length = leaf.record.shape[0] if data.ndim else 1
    return pieces(rows, length, chunk_rows, row_bytes, max(1, budget // 4))


def batch_writers(leaves: list, batches: dict[str, BatchRecord], me: int, own_copy: bool):
    """``{batch: its writer}``; an own copy: this process where it holds every leaf, else -1."""
    if not own_copy:
        return {n: b.process for n, b in batches.items()}
    held = dict.fromkeys(batches, me)
    for leaf in leaves:
        storage = leaf.record.storage
        if isinstance(storage, BatchStorage) and isinstance(leaf.value, jax.Array):
            if me not in {d.process_index for d in leaf.value.sharding.device_set}:
                held[storage.batch] = -1
    return held


def owned_regions(leaves: list, writers: dict[str, int], me: int, own_copy: bool) -> list:
    """(leaf, source, region) for every piece this process writes; each source resolved once."""
    owned: list[tuple[Any, Any, tuple | None]] = []
    for leaf in leaves:
        value, storage = leaf.value, leaf.record.storage
        if storage is None:
            continue
        if isinstance(storage, BatchStorage):
            if writers[storage.batch] == me:
                if isinstance(value, jax.Array):
                    value = _local_replica(value, None)
                owned.append((leaf, value, None))
        elif isinstance(value, jax.Array):
            shape, chunk = leaf.record.shape, storage.chunk_shape
            for index, holders in _replica_groups(value.sharding, shape):
                mine = [me] if own_copy and me in holders else holders  # own copy: whole shards
                rows = _my_rows(index, shape, chunk, mine, me)
                if rows is not None:
                    owned.append((leaf, (_local_replica(value, index), index), rows))
        elif me == 0 or own_copy:
            owned.append((leaf, value, tuple(slice(None) for _ in value.shape)))
    return owned


def _copy_small(storage: BatchStorage, source, batch_data, pieces, ends, pool) -> None:
    """A small leaf's host copy: a piece of its batch, or copied into the pooled one."""
    name = storage.batch
    off, size = storage.offset, storage.size
    if storage.packed:  # a sub-byte leaf: its packed bytes (a new array)
        source = _subbyte.pack_flat(np.asarray(source))
    if pool is None:
        if isinstance(source, jax.Array):
            host = _host_copy(source, None)
        elif storage.packed:
            host = source
        else:  # numpy or scalar: the caller may change it after we return
            host = _host.copy(np.asarray(source))
        pieces[name].append((off * host.dtype.itemsize, host))
        return
    buf = batch_data[name]
    buf[ends[name] : off] = 0  # alignment padding: never uninitialised memory
    buf[off : off + size] = np.asarray(source).reshape(-1)
    ends[name] = off + size


def _copy_region(source, rows, pool, keep, later: list, kind: str, summed):
    """The host copy (accelerator arrays: a ``Deferred``) of the region ``rows``."""
    if isinstance(source, tuple):
        data, index = source
        part = _relative(rows, index)
        if on_device(data):
            if kind == "fetch":  # brought over when the writer gets to it
                return _device_copy.OnDevice(data, part)
            return _device_copy.start(data, part, kind=kind)
        streamed = kind == "streamed"
        if streamed:  # a budget: the save waits for the views to be written
            host = np.asarray(data)
            return host if part is None else host[part]
        if pool is not None and data.device.platform == "cpu":
            host = np.asarray(data)
            return keep(_pooled(pool, host if part is None else host[part], rows, later, summed))
        return _host_copy(data, part)
    if kind == "streamed":  # a numpy leaf under a budget: written before the save returns
        return np.asarray(source)
    if pool is None:
        return _host.copy(np.asarray(source))
    return keep(_pooled(pool, np.asarray(source), rows, later, summed))


def _pooled(pool: BufferPool, host: np.ndarray, rows, later: list, summed) -> np.ndarray:
    """A pooled buffer for ``host``, its copy left in ``later`` in whole chunk rows."""
    out = pool.empty(host.shape, host.dtype)
    shape, chunk, crcs = summed or ((), (), None)
    if not shape or not rows:
        later.append((out, host))
        return out
    row_bytes = math.prod(host.shape[1:]) * host.dtype.itemsize
    start = rows[0].start or 0
    for piece in pieces(rows, shape[0], chunk[0], row_bytes, _host.COPY_PIECE):
        at = slice((piece[0].start or 0) - start, (piece[0].stop or shape[0]) - start)
        copier = functools.partial(
            _chunks.copy_with_crcs, shape=shape, chunk=chunk, index=piece, out=crcs
        )
        later.append((out[at], host[at], copier))
    return out


@functools.lru_cache(maxsize=4096)
def _replica_groups(sharding: jax.sharding.Sharding, shape: tuple[int, ...]):
    """``[(index, holder processes sorted), ...]``, one entry per distinct shard region."""
    groups: dict[tuple, tuple[tuple[slice, ...], set[int]]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) for s in index)
        groups.setdefault(key, (index, set()))[1].add(device.process_index)
    return [(index, sorted(procs)) for index, procs in groups.values()]


def _my_rows(index: tuple[slice, ...], shape, chunk, holders: list[int], me: int):
    """The whole chunk rows of shard ``index`` that ``me`` writes, split over its holders."""
    if me not in holders:
        return None
    k, m = holders.index(me), len(holders)
    if not shape or m == 1:
        return index if k == 0 else None
    start = index[0].start or 0
    stop = shape[0] if index[0].stop is None else index[0].stop
    rows = chunk[0]
    n = -(-(stop - start) // rows)
    lo, hi = k * n // m, (k + 1) * n // m
    if lo >= hi:
        return None
    return (slice(start + lo * rows, min(start + hi * rows, stop)),) + tuple(index[1:])


def _local_replica(value: jax.Array, index: tuple[slice, ...] | None) -> jax.Array:
    """A single-device array on this process holding region ``index`` (None: all)."""
    if len(value.sharding.device_set) == 1:
        return value
    want = None if index is None else tuple((s.start, s.stop) for s in index)
    best = None
    for shard in value.addressable_shards:
        if want is None or tuple((s.start, s.stop) for s in shard.index) == want:
            if best is None or shard.replica_id < best.replica_id:
                best = shard
    if best is None:
        raise AssertionError("this process holds no replica of the region it writes")
    return best.data


def _relative(rows: tuple[slice, ...], index: tuple[slice, ...]) -> tuple[slice, ...] | None:
    if not rows or rows[0] == index[0]:
        return None
    start = index[0].start or 0
    return (slice(rows[0].start - start, rows[0].stop - start),)


def _host_copy(data: jax.Array, part: tuple[slice, ...] | None) -> np.ndarray:
    """Host bytes of ``data`` no later donation can change (on CPU: a view, where safe)."""
    host = np.asarray(data)
    if part is not None:
        host = host[part]
    if data.device.platform == "cpu":
        return host if cpu_views_are_snapshots() else _host.copy(host)
    return _host.copy(host) if part is not None else host


@functools.cache
def cpu_views_are_snapshots() -> bool:
    """Whether a numpy view of a CPU jax.Array outlives its donation (checked once)."""
    cpu = jax.local_devices(backend="cpu")[0]  # this process's (several: not devices()[0])
    base = np.arange(4096, dtype=np.float32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "donated buffers were not usable"
            x = jax.device_put(base, cpu)
            view = np.asarray(x)
            y = jax.jit(lambda a: a * 3 + 1, donate_argnums=0)(x)
            y.block_until_ready()
            z = jax.device_put(base + 1, cpu)
            view_z = np.asarray(z)
            z.delete()
            filler = [jax.device_put(base * 7, cpu) for _ in range(4)]  # reuse freed memory
            jax.block_until_ready(filler)
            return bool(np.array_equal(view, base) and np.array_equal(view_z, base + 1))
    except Exception:  # noqa: BLE001  (any doubt: copy)
        return False


def batch_jobs(batch_specs, batches, batch_data, writer) -> list:
    jobs = []
    for name, spec in batch_specs:
        if name in batch_data:
            data = batch_data.pop(name)
            if writer is not None and batches[name].codec is None:
                sub, b = batch_dir(name), batches[name]
                write = lambda _i, d, sub=sub, b=b: writer.batch(sub, b.chunk, b.inner, d)
                jobs.append((spec, [((slice(None),), data)], write))
            else:
                jobs.append((spec, [((slice(None),), _assembled(data))], None))
    return jobs


def _assembled(data: Any) -> Any:
    return data.assemble() if isinstance(data, _packed_writer.Gathered) else data


class WritesInFlight:
    """Writes in flight, drained past ``limit`` bytes; ``written``: the bytes handed out."""

    def __init__(self, limit: int, cancelled: threading.Event | None = None):
        self.limit = limit
        self.cancelled = cancelled
        self.futures: collections.deque = collections.deque()
        self.in_flight = 0
        self.written = 0
        self.progress = _host.Progress()

    def report(self, total: int):
        """Begins this thread's activity (``total`` bytes); the caller ends it."""
        doing = _host.ACTIVITIES.begin("writing this process's data", moving=True)
        self.progress = doing.progress
        self.progress.total = total
        return doing

    def fail(self, error: BaseException, staging: Location, *, direct: bool) -> None:
        """After ``error``: every write in flight waited for; theirs raised as CheckpointError."""
        settle(self.futures)
        if isinstance(error, ValueError):  # tensorstore's status text, with its whole spec
            text = str(error).split(" [tensorstore_spec=", 1)[0]
            raise CheckpointError(f"writing array data to {staging} failed: {text}") from error
        if isinstance(error, OSError) and direct:
            raise CheckpointError(f"writing array data to {staging} failed: {error}") from error

    def drain(self, to: int) -> None:
        while self.futures and (self.in_flight > to or self.futures[0][0].done()):
            future, nbytes = self.futures.popleft()
            future.result()
            self.in_flight -= nbytes
            self.progress.done = self.written - self.in_flight

    def write_all(self, jobs: list) -> None:
        for spec, writes, direct in jobs:
            self._write(spec, writes, direct)

    def _write(self, spec, writes: list, direct) -> None:
        """Writes every region of one job (popped: each buffer is released once written)."""
        store = None
        while writes:
            raise_if_cancelled(self.cancelled, "the save, while writing its data,")
            index, data = writes.pop()
            data = materialize(data)  # a region still on its device: copied now
            if data.size:
                futures = direct(index, data) if direct is not None else None
                if futures is None:
                    if store is None:
                        store = _arrays.open_for_write(spec)
                    stored = _arrays.as_stored(data, store.dtype.numpy_dtype)
                    write = store[index].write(stored, can_reference_source_data_indefinitely=True)
                    futures = [write.commit]
                share = data.nbytes // max(1, len(futures))
                self.futures.extend((future, share) for future in futures)
                self.in_flight += share * len(futures)
                self.written += data.nbytes
                if self.written == data.nbytes:
                    _env.kill_point("mid_write")
                    _env.pause_point("mid_write")
                _env.slow_point("write")  # tests: a slow but progressing write
            del data
            self.drain(self.limit)


def settle(pending) -> None:
    """Waits for every future, ignoring their errors (the first one is raised already)."""
    for future, _ in pending:
        try:
            future.result()
        except Exception:  # noqa: BLE001
            pass


def write_packed(
    staging: Location, leaves: list, snap: Any, reuse: Callable[[], Any] | None
) -> tuple[int, dict[str, str], int]:
    """Version 2: this process's chunks into its data files: (written, {index: sha256}, reused)."""
    if sys.byteorder != "little":
        raise CheckpointError("format_version=2 is written on little-endian hosts only")
    req, batches, batch_data = snap.request, snap.batches, snap.batch_data
    total = sum(data.nbytes for leaf in leaves for _, data in leaf.writes)
    total += sum(data.nbytes for data in batch_data.values())
    taken = None if reuse is None else reuse()
    budget = req.host_memory_budget
    gathered = None if budget is None else budget // 4
    process = _distributed.process_index()
    writer = _packed_writer.PackedWriter(
        staging, process, req.data_file_bytes, total, gathered_bytes=gathered
    )
    jobs = _packed_jobs(writer, taken, leaves, batches, batch_data)
    pending = WritesInFlight(req.limit, req.cancelled)
    doing = pending.report(total)  # bytes done and left, in this process's heartbeat
    try:
        try:
            pending.write_all(jobs)
            pending.drain(0)
        finally:
            writer.close()
            _host.ACTIVITIES.end(doing)
    except BaseException as e:
        pending.fail(e, staging, direct=True)
        raise
    dtypes = {batch_dir(name): b.dtype for name, b in batches.items()}  # as stored
    for leaf in leaves:
        if isinstance(leaf.record.storage, ArrayStorage):
            dtypes[array_dir(leaf.index)] = _subbyte.stored(leaf.record).dtype
    name, raw = writer.write_index(dtypes)
    return pending.written, {name: sha256(raw)}, 0 if taken is None else taken.nbytes


def _packed_jobs(writer: _packed_writer.PackedWriter, taken, leaves, batches, batch_data) -> list:
    """The data files ``taken`` adopted, the unchanged leaves first, then the rest."""
    stable: frozenset[int] = frozenset()
    if taken is not None:
        writer.adopt(taken.files, taken.chunks)
        stable = taken.unchanged - taken.leaves
        for leaf in leaves:
            if leaf.index in taken.leaves:
                leaf.writes.clear()  # drop the snapshot: the data file taken holds it
    jobs = [
        (None, leaf.writes, _direct(writer, leaf))
        for leaf in sorted(leaves, key=lambda leaf: leaf.index not in stable)
        if isinstance(leaf.record.storage, ArrayStorage) and leaf.writes
    ]
    plain = [(name, None) for name, b in batches.items() if b.codec is None]
    jobs += batch_jobs(plain, batches, batch_data, writer)
    for name, batch in batches.items():  # each compressed batch encoded whole in memory
        if batch.codec is not None and name in batch_data:
            data = _assembled(batch_data.pop(name))
            spec = _arrays.batch_spec(_arrays.MEMORY, batch)
            sub = batch_dir(name)
            write = lambda index, data, sub=sub, spec=spec: [
                writer.encoded(sub, spec, [(index, data)])
            ]
            jobs.append((None, [((slice(None),), data)], write))
    return jobs


def _direct(writer: _packed_writer.PackedWriter, leaf):
    record = leaf.record
    chunk = record.storage.chunk_shape
    spec = None
    if record.storage.codec is not None:
        spec = _arrays.leaf_spec(_arrays.MEMORY, leaf.index, record)

    def write(index, data):
        sub = array_dir(leaf.index)
        if spec is None:
            futures = writer.array(sub, record.shape, chunk, index, data, leaf.crcs)
        else:
            whole = _chunks.whole_chunks(record.shape, chunk, index)
            ok = whole is not None and data.shape == whole[0]
            futures = [writer.encoded(sub, spec, [(index, data)])] if ok else None
        if futures is None:
            raise CheckpointError(
                f"leaf {record.path!r}: a region {index} that is not whole chunks of "
                f"{record.storage.chunk_shape}; format_version=2 stores whole chunks only"
            )
        return futures

    return write
