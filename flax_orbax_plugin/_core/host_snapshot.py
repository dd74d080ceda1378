"""Device-to-host copies of what a save writes: the device, pinned and host stagings
(:func:`staging_for`), streaming under a budget, and the blocking phase's host copy
(:func:`take_small`, :func:`take_regions`). Called on the saving thread, once per save;
:func:`fetch` and :func:`materialize` on the background phase's thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.host_snapshot``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base import distributed as _distributed
from .._base import host as _host
from .._base.buffer_pool import BufferPool
from .._format import layout as _layout
from .._format.layout import BatchRecord, BatchStorage
from .._zarr import chunks as _chunks
from .._zarr import packed_writer as _packed_writer

CPU_AS_DEVICE = False  # treat CPU arrays as device arrays (exercises this path on CPU)
FETCH_PIECE = 16 << 20  # bytes of one background transfer of the device staging
SNAPSHOT_HEADROOM = 0.9  # the device copy takes at most this share of a device's free memory


def staging_for(platform: str) -> str:
    """The staging of a save whose arrays live on ``platform`` (see the module's doc)."""
    if platform == "tpu" or (platform == "cpu" and CPU_AS_DEVICE):
        return "device"
    if platform in ("gpu", "cuda", "rocm"):
        return "pinned"
    return "host"


@dataclasses.dataclass(frozen=True)
class Staging:
    """How one save's blocking phase copied its accelerator arrays: ``kind`` (device,
    pinned, host, streamed, or none where nothing is on a device) and, for a fallback,
    ``note`` (why)."""

    kind: str = "none"
    note: str = ""

    def __str__(self) -> str:
        return f"{self.kind} ({self.note})" if self.note else self.kind


@functools.partial(jax.jit, donate_argnums=())
def _copy_all(arrays: list) -> list:
    return [jnp.copy(x) for x in arrays]


def free_bytes(device: Any) -> int | None:
    """Bytes free on ``device`` (None: the platform does not say)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (a platform without memory statistics)
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def snapshot(arrays: list) -> tuple[list | None, str]:
    """A copy of every array of ``arrays`` on its own devices (enqueued: one jitted call
    per local device over the shards it holds, each array then reassembled from its
    copied shards), or (None, why) where some device lacks the memory for it. Called in
    the blocking phase, on the saving thread; reads no device value. No collective: with
    several processes each copies its own shards and decides its fallback alone."""
    need: dict[Any, int] = {}
    for x in arrays:
        for shard in x.addressable_shards:
            need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
    for device, nbytes in need.items():
        free = free_bytes(device)
        if free is not None and nbytes > free * SNAPSHOT_HEADROOM:
            return None, (
                f"device memory short on {device}: the copy needs {nbytes} bytes, "
                f"{max(free, 0)} free"
            )
    shards = [[s.data for s in x.addressable_shards] for x in arrays]
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for i, pieces in enumerate(shards):
        for j, piece in enumerate(pieces):
            by_device.setdefault(next(iter(piece.devices())), []).append((i, j))
    copied: list[list] = [[None] * len(pieces) for pieces in shards]
    for members in by_device.values():
        outs = _copy_all([shards[i][j] for i, j in members])
        for (i, j), c in zip(members, outs, strict=True):
            copied[i][j] = c
    copies = [
        pieces[0]
        if len(pieces) == 1
        and x.sharding.is_fully_addressable
        and x.ndim == pieces[0].ndim
        and len(x.sharding.device_set) == 1
        else jax.make_array_from_single_device_arrays(x.shape, x.sharding, pieces)
        for x, pieces in zip(arrays, copied, strict=True)
    ]
    return copies, ""


class Deferred:
    """A region's bytes, still on a device or on their way to host memory."""

    __slots__ = ("array",)

    def __init__(self, array: jax.Array):
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.array.dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def on_device(data: Any) -> bool:
    """Whether ``data`` (a single-device jax.Array) takes the device path."""
    if not isinstance(data, jax.Array):
        return False
    return CPU_AS_DEVICE or next(iter(data.devices())).platform != "cpu"


def start(data: jax.Array, part: tuple[slice, ...] | None, *, kind: str) -> Deferred:
    """The region ``part`` (None: all) of the single-device array ``data``, as the
    staging ``kind`` says: ``streamed``, copied on the device; ``pinned``, its copy into
    pinned host memory enqueued (``host`` where the device has none); ``host``, its
    ``copy_to_host_async`` started (the caller reads it before the blocking phase ends:
    a donation would delete ``data``)."""
    if kind == "streamed":  # a copy on the device, which no donation of ``data`` invalidates
        return Deferred(jnp.copy(data) if part is None else data[part])
    region = data if part is None else data[part]
    device = next(iter(region.devices()))
    if kind == "pinned" and "pinned_host" in {m.kind for m in device.addressable_memories()}:
        target = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        return Deferred(jax.device_put(region, target))
    region.copy_to_host_async()
    return Deferred(region)


def fetch(data: jax.Array, part: tuple[slice, ...] | None) -> np.ndarray:
    """Host bytes of the region ``part`` (None: all) of the single-device array
    ``data``, brought over in pieces of whole rows of at most :data:`FETCH_PIECE`
    bytes, one in flight at a time (background phase, device staging)."""
    region = data if part is None else data[part]
    shape = tuple(region.shape)
    if not shape or region.nbytes <= FETCH_PIECE or shape[0] <= 1:
        return np.asarray(region)
    out = np.empty(shape, np.dtype(region.dtype))
    rows = max(1, FETCH_PIECE // max(1, region.nbytes // shape[0]))
    for lo in range(0, shape[0], rows):
        out[lo : lo + rows] = np.asarray(region[lo : lo + rows])
    return out


class OnDevice(Deferred):
    """The region ``part`` of a device copy (the device staging), brought to host by
    :func:`fetch` when the background writer gets to it: the transfer of one region
    overlaps the writes of those before it, and no more than the writes in flight is
    held in host memory."""

    __slots__ = ("part",)

    def __init__(self, array: jax.Array, part: tuple[slice, ...] | None):
        super().__init__(array)
        self.part = part

    @property
    def shape(self) -> tuple[int, ...]:
        if self.part is None:
            return tuple(self.array.shape)
        return tuple(
            len(range(*s.indices(n))) for s, n in zip(self.part, self.array.shape, strict=False)
        ) + tuple(self.array.shape[len(self.part) :])


def materialize(data: Any) -> Any:
    """Host bytes of ``data`` (a :class:`Deferred` is copied, or waited for, here)."""
    if isinstance(data, OnDevice):
        return fetch(data.array, data.part)
    if isinstance(data, Deferred):
        return np.asarray(data.array)
    return data


def materialize_all(leaves: list) -> None:
    """Every :class:`Deferred` of the leaves' writes replaced by its host bytes (for
    the writers that read every region up front: format version 2, incremental)."""
    for leaf in leaves:
        writes = getattr(leaf, "writes", None)
        if writes:
            leaf.writes = [(rows, materialize(data)) for rows, data in writes]


def pieces(
    rows: tuple[slice, ...], length: int, chunk_rows: int, row_bytes: int, most: int
) -> list:
    """``rows`` (a region of whole chunk rows along axis 0 of an array of ``length``
    rows) cut into consecutive regions of whole chunk rows of at most ``most`` bytes
    each (at least one chunk row)."""
    if not rows or row_bytes <= 0:
        return [rows]
    start = rows[0].start or 0
    stop = length if rows[0].stop is None else rows[0].stop
    step = max(1, most // (row_bytes * chunk_rows)) * chunk_rows
    if stop - start <= step:
        return [rows]
    return [(slice(lo, min(lo + step, stop)),) + tuple(rows[1:]) for lo in range(start, stop, step)]


def take_small(leaves: list, batches: dict[str, BatchRecord], pool, own_copy: bool = False):
    """The batches of small leaves this process writes, read now (every device-to-host
    copy started first): (batch name -> its data, pooled buffers to give back). Called
    before any large region's transfer is enqueued, so no read waits behind one."""
    me = _distributed.process_index()
    pooled: list[np.ndarray] = []
    keep = _keeper(pool, pooled)  # a pooled buffer is given back after the write
    writers = _writers(leaves, batches, me, own_copy)
    owned = [o for o in _owned(leaves, writers, me, own_copy) if _is_small(o[0])]
    for _, source, _ in owned:
        if on_device(source):
            source.copy_to_host_async()
    batch_data = _take_small(owned, batches, writers, me, pool, keep)
    for leaf, _, _ in owned:
        leaf.value = None  # the snapshot is all the background phase needs
    return batch_data, pooled


def take_regions(
    leaves: list,
    batches: dict[str, BatchRecord],
    pool,
    own_copy: bool = False,
    budget: int | None = None,
    device_kind: str = "pinned",
):
    """The regions of the leaves stored as arrays of their own that this process
    writes, each into its leaf's ``writes`` (``own_copy``: every region it holds,
    replicas included, under the shared layout's names): (pooled buffers to give
    back, whether the save must wait for its writes before returning).

    Accelerator arrays are staged as ``device_kind`` says (``_device_copy``: ``pinned``
    or ``host`` in the blocking phase; ``fetch``, in the background phase of the device
    staging, from the copy :func:`snapshot` made), or streamed with a
    ``budget``, in pieces of at most a quarter of it. With a ``budget``, CPU arrays are
    held as zero-copy views and nothing is copied: the save then returns only once they
    are written (the second value), so no copy of the state is ever made."""
    me = _distributed.process_index()
    pooled: list[np.ndarray] = []
    keep = _keeper(pool, pooled)  # a pooled buffer is given back after the write
    writers = _writers(leaves, batches, me, own_copy)
    owned = [o for o in _owned(leaves, writers, me, own_copy) if not _is_small(o[0])]
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


def _keeper(pool, pooled: list[np.ndarray]):
    """The function that records a buffer taken from ``pool`` (into ``pooled``, given
    back once written) and returns it; records nothing without a pool."""

    def keep(buffer: np.ndarray) -> np.ndarray:
        if pool is not None:
            pooled.append(buffer)
        return buffer

    return keep


def _is_small(leaf) -> bool:
    return isinstance(leaf.record.storage, BatchStorage)


def _writers(leaves: list, batches: dict, me: int, own_copy: bool) -> dict[str, int]:
    if own_copy:
        return _held_batches(leaves, batches, me)
    return {n: b.process for n, b in batches.items()}


def _take_small(owned: list, batches: dict, writers: dict, me: int, pool, keep) -> dict:
    """The batches this process writes, from their small leaves: with a pool, copied
    into one pooled buffer per batch; otherwise each leaf's own host snapshot (a
    zero-copy view on CPU, see _host_copy), the batch written from those pieces
    (gathered, never copied on this thread)."""
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
        if isinstance(leaf.record.storage, BatchStorage):
            _copy_small(leaf.record.storage, source, batch_data, pieces, ends, pool)
    for name, end in ends.items():
        if name in pieces:
            batch = batches[name]
            dtype = _layout.dtype_from_name(batch.dtype)
            batch_data[name] = _packed_writer.Gathered(pieces[name], dtype, batch.size)
        else:
            batch_data[name][end:] = 0
    return batch_data


def pool_sizes(leaves: list, batches: dict[str, BatchRecord], own_copy: bool = False) -> list:
    """The byte size of every buffer :func:`take` with a pool takes for these leaves (a
    plan's) and batches: each batch this process writes, each region it copies of a CPU
    or numpy leaf stored as its own array (accelerator regions go to pinned memory, not
    to the pool). Reads no array data."""
    me = _distributed.process_index()
    writers = {n: b.process for n, b in batches.items()}
    if own_copy:
        writers = _held_batches(leaves, batches, me)
    sizes = [
        b.size * _layout.dtype_from_name(b.dtype).itemsize
        for n, b in batches.items()
        if writers[n] == me
    ]
    for leaf, source, rows in _owned(leaves, writers, me, own_copy):
        if isinstance(leaf.record.storage, BatchStorage):
            continue
        data = source[0] if isinstance(source, tuple) else source
        if on_device(data):
            continue
        extents = [len(range(*r.indices(n))) for r, n in zip(rows, leaf.record.shape, strict=True)]
        sizes.append(math.prod(extents) * np.dtype(data.dtype).itemsize)
    return sizes


# Checksum each chunk as it is copied into the pool (one pass) instead of in the
# writer: on where the C kernel is built (_zarr/_copycrc.c computes the crc as it
# copies; benchmarks/results/onepass_kernel.json: a save's CPU 0.376 -> 0.263 s per
# 1.2 GB, the blocking phase as long), off without it (the one pass in Python saves
# less CPU and lengthens the blocking phase: 0.132 -> 0.213 s). Either way the
# carried checksums are proven equal to the bytes written (tests/core/test_onepass_crcs.py).
ONE_PASS = _chunks.has_kernel()


def _summed(leaf):
    """(shape, chunk shape, the leaf's crcs) for a pooled copy that checksums its
    chunks; None for a packed or compressed leaf (the writer checksums other bytes),
    and while :data:`ONE_PASS` is off."""
    storage = leaf.record.storage
    if not ONE_PASS or storage.codec is not None or _chunks.is_packed(leaf.record):
        return None
    return leaf.record.shape, storage.chunk_shape, leaf.crcs


def _pieces(leaf, source, rows, budget: int | None) -> list:
    """``[rows]``, or with a ``budget`` a device region cut into pieces of whole chunk
    rows of at most a quarter of it (each copied to host on its own)."""
    if budget is None or not isinstance(source, tuple) or not on_device(source[0]):
        return [rows]
    data = source[0]
    row_bytes = math.prod(data.shape[1:]) * np.dtype(data.dtype).itemsize
    chunk_rows = leaf.record.storage.chunk_shape[0] if data.ndim else 1
    length = leaf.record.shape[0] if data.ndim else 1
    return pieces(rows, length, chunk_rows, row_bytes, max(1, budget // 4))


def _held_batches(leaves: list, batches: dict[str, BatchRecord], me: int) -> dict[str, int]:
    """``{batch: me}`` for each batch every leaf of which this process holds (own copy)."""
    held = dict.fromkeys(batches, me)
    for leaf in leaves:
        storage = leaf.record.storage
        if isinstance(storage, BatchStorage) and isinstance(leaf.value, jax.Array):
            if me not in {d.process_index for d in leaf.value.sharding.device_set}:
                held[storage.batch] = -1
    return held


def _owned(leaves: list, writers: dict[str, int], me: int, own_copy: bool) -> list:
    """(leaf, what to read it from, region) for every piece this process writes; each
    source is resolved once, so the object whose device-to-host copy is started is the
    one read afterwards (jax caches the copy per object)."""
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
        source = _chunks.pack_flat(np.asarray(source))
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
    """The host copy of the region ``rows`` of a leaf stored as its own array (of an
    accelerator array: a ``Deferred``). A
    pooled copy is checksummed as it is copied (``summed``: the leaf's shape, chunk
    shape and crcs, see :func:`_pooled`)."""
    if isinstance(source, tuple):
        data, index = source
        part = _relative(rows, index)
        if on_device(data):
            if kind == "fetch":  # brought over when the writer gets to it
                return OnDevice(data, part)
            return start(data, part, kind=kind)
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
    """A pooled buffer for ``host`` (the region ``rows``, global, of a leaf), its copy
    left in ``later`` for ``copy_all``, cut into pieces of whole chunk rows each copied
    and checksummed in one pass (``_zarr.chunks.copy_with_crcs``): every chunk's crc32c
    lands in the leaf's ``crcs`` (``summed``: (shape, chunk shape, crcs)), and the
    writer does not read the chunk again to checksum it; ``summed`` None: copied only."""
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
    """The part of shard ``index`` that process ``me`` writes: a contiguous range of whole
    chunk rows (axis 0), split evenly over the processes holding a replica of it."""
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
    """A single-device array on this process holding region ``index`` (None: the whole
    unpartitioned value)."""
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
    """``rows`` (global) relative to the shard region ``index``; None when equal."""
    if not rows or rows[0] == index[0]:
        return None
    start = index[0].start or 0
    return (slice(rows[0].start - start, rows[0].stop - start),)


def _host_copy(data: jax.Array, part: tuple[slice, ...] | None) -> np.ndarray:
    """Host bytes of ``data`` that no later donation, deletion or update can change.

    On CPU, ``np.asarray`` is a zero-copy view of the device buffer, and jax does not
    donate or free a buffer while such a view is alive (a donating step then allocates
    a new output): the view *is* a snapshot, held until its chunks are written, and the
    blocking phase copies nothing. That is checked once per process
    (:func:`cpu_views_are_snapshots`); where it does not hold, the bytes are copied.
    Elsewhere ``np.asarray`` is a fresh device-to-host copy already.
    """
    host = np.asarray(data)
    if part is not None:
        host = host[part]
    if data.device.platform == "cpu":
        return host if cpu_views_are_snapshots() else _host.copy(host)
    return _host.copy(host) if part is not None else host


@functools.cache
def cpu_views_are_snapshots() -> bool:
    """Whether a numpy view of a CPU jax.Array keeps its bytes through a donation of the
    array, its deletion and the donating step's output (checked on this jax, once)."""
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
