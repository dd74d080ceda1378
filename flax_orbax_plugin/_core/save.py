"""Saving a pytree: validation, host snapshot, background write.

Call order, on every process (SPMD: all processes save the same tree structure in the
same order):

1. Blocking phase (:func:`snapshot`, on the caller's thread): flatten and validate the
   tree, plan the layout (typed records of ``_layout``), start every device-to-host
   copy and wait for them (one host copy of the bytes this process writes). From
   here on the caller may donate or overwrite the saved arrays.
2. Background phase (:meth:`Snapshot.write`, on a background thread): the primary
   creates every array's ``zarr.json`` and writes ``_METADATA.json``; every process
   writes its own chunks through tensorstore within the host-memory budget and makes
   them durable (one syncfs). No commit: the caller commits through ``_commit``,
   once for a whole manager step, or once per :func:`save_async`.

Who writes what: a partitioned array's shards are written by the processes that hold
them; the replicas of a shard (or of a whole replicated array) split its chunk rows
among the processes holding them (replica-parallel), so no process writes more than
its share; small unpartitioned leaves are packed into one batch per process and
dtype, written by the process holding replica 0.

Only one :func:`save_async` runs at a time in a process; a second one waits for it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import threading
import time
from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import faults as _faults
from .._base import host as _host
from .._base import tree as _tree
from .._errors import CheckpointError, StructureError
from .._format import layout as _layout
from .._format import metadata as _metadata
from .._format.layout import (
    COMMIT_FILE,
    METADATA_FILE,
    ArrayStorage,
    BatchRecord,
    BatchStorage,
    CheckpointDocument,
    CommitMarker,
    LeafRecord,
)
from .._incremental import reuse as _incremental
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunk_files as _chunk_files
from . import commit as _commit
from . import ownership as _ownership

SMALL_LEAF_BYTES = 1 << 20  # unpartitioned leaves up to this size are batched
DEFAULT_MEMORY_LIMIT_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """Figures of one finished save (a core checkpoint or a manager step), as seen by
    this process.

    ``blocking_seconds``: how long the caller waited; ``total_seconds``: from the start
    of the save until it committed; ``bytes_written``: array bytes this process wrote;
    ``bytes_reused``: array bytes of unchanged leaves hard-linked (local disk) or copied
    on the server (S3, GCS) from the previous step instead of written (incremental
    manager steps; not part of ``bytes_written``).
    """

    path: str
    blocking_seconds: float
    total_seconds: float
    bytes_written: int
    step: int | None = None
    bytes_reused: int = 0

    @property
    def gigabytes_per_second(self) -> float:
        return self.bytes_written / max(self.total_seconds, 1e-9) / 1e9

    def as_scalars(self) -> dict[str, float]:
        """For a metric writer: ``checkpoint/blocking_seconds`` and friends
        (``checkpoint/bytes_reused`` only when a step reused bytes)."""
        out = {
            "checkpoint/blocking_seconds": self.blocking_seconds,
            "checkpoint/total_seconds": self.total_seconds,
            "checkpoint/bytes": float(self.bytes_written),
            "checkpoint/gbytes_per_sec": self.gigabytes_per_second,
        }
        if self.bytes_reused:
            out["checkpoint/bytes_reused"] = float(self.bytes_reused)
        return out


class SaveHandle:
    """A save whose background phase may still run: ``wait()`` returns its
    :class:`SaveResult` or re-raises its error (an error is never dropped: a handle
    nobody waited on raises at the next save).

    Thread-safety: ``wait`` and ``done`` may be called from any thread.
    """

    def __init__(self, path: str, target: Any):
        self.path = path
        self._target = target
        self._thread = threading.Thread(target=self._run, name="fop-save", daemon=False)
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._reported = False

    def start(self) -> SaveHandle:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._result = self._target()
        except BaseException as e:  # noqa: BLE001  (re-raised on wait)
            e.add_note(f"raised by the background phase of the save to {self.path}")
            self._error = e
        finally:
            self._target = None  # drop the host snapshot

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Blocks until the save is committed; raises its error if it failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"save to {self.path} still running after {timeout}s")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._result is not None
        return self._result

    def raise_unreported(self) -> None:
        """Waits; re-raises the error only if no ``wait()`` has reported it yet."""
        self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error


_IN_FLIGHT: list[SaveHandle] = []  # the latest save_async
_IN_FLIGHT_LOCK = threading.Lock()


def wait_for_pending_save(location: Location | None = None) -> None:
    """Waits for the in-flight :func:`save_async` (only if it targets ``location``, when
    given); re-raises an error that ``wait()`` has not already reported."""
    for handle in list(_IN_FLIGHT):
        if location is None or handle.path == str(location):
            handle.raise_unreported()


def save(
    path: Any,
    tree: Any,
    *,
    force: bool = False,
    memory_limit_bytes: int | None = None,
    compression: str | None = None,
):
    """Saves ``tree`` to ``path``; durable and committed on return.

    See :func:`save_async` for the arguments.
    """
    return save_async(
        path, tree, force=force, memory_limit_bytes=memory_limit_bytes, compression=compression
    ).wait()


def save_async(
    path: Any,
    tree: Any,
    *,
    force: bool = False,
    memory_limit_bytes: int | None = None,
    compression: str | None = None,
) -> SaveHandle:
    """Starts saving ``tree`` to ``path``; returns once the tree is snapshotted to host.

    Args:
      path: a local directory, an ``s3://``/``gs://`` URL or a tensorstore kvstore spec.
        It must not hold a committed checkpoint unless ``force``.
      tree: dicts, lists, tuples, NamedTuples, registered dataclasses; leaves are
        jax.Arrays (any sharding), numpy arrays, numpy or Python scalars, typed PRNG
        key arrays, or None.
      force: replace a committed checkpoint at ``path``.
      memory_limit_bytes: bound on bytes handed to tensorstore and not yet written.
      compression: None, or ``"zstd"`` / ``"zstd:<level 1-22>"``: every chunk is
        compressed before its checksum (zarr3 ``zstd`` codec; recorded per array, so
        restore needs no option).

    Returns:
      A :class:`SaveHandle`; ``handle.wait()`` returns a :class:`SaveResult`.
    """
    with _IN_FLIGHT_LOCK:
        wait_for_pending_save()
        start = time.perf_counter()
        location = Location.from_path(path)
        snap = snapshot(tree, compression=compression)
        _check_target(location, force)
        # Object stores write in place: remains of a dead save, or with ``force`` a
        # checkpoint of ours, are cleared first (proven ours by _check_target).
        clear_first = not location.supports_rename and not _ownership.is_empty(location)
        staging = _commit.Staging.begin(location, _distributed.unique_name(), claim=False)
        op = _distributed.next_operation_id("save")
        blocking = time.perf_counter() - start
        limit = memory_limit_bytes or DEFAULT_MEMORY_LIMIT_BYTES

        def background() -> SaveResult:
            if clear_first:  # object store, no rename: start from an empty prefix
                if _distributed.is_primary():
                    _ownership.remove(location, action="clear")
                _distributed.barrier(f"{op}/cleared")

            def write() -> _commit.Written:
                staging.claim()  # before any data: a dead save's remains are provably ours
                return snap.write(staging.location, limit=limit)

            written = _commit.commit_collectively(
                op,
                what=f"save to {location}",
                step=None,
                digest=snap.digest,
                write=write,
                publish=lambda files: staging.publish(
                    COMMIT_FILE, CommitMarker(files, time.time()).to_bytes(), replace=force
                ),
                abort=staging.abort,
            )
            total = time.perf_counter() - start
            return SaveResult(str(location), blocking, total, written.bytes_written)

        handle = SaveHandle(str(location), background)
        _IN_FLIGHT[:] = [handle]
        return handle.start()


def is_committed(path: Any) -> bool:
    """True when ``path`` holds a committed standalone checkpoint."""
    return Location.from_path(path).exists(COMMIT_FILE)


def _check_target(location: Location, force: bool) -> None:
    """Refuses a target held by anything foreign (ForeignEntryError, even with
    ``force``) and a committed checkpoint of ours without ``force``. Every process
    looks (they share the store), so all refuse together rather than the others
    waiting for a primary that raised."""
    _ownership.check_slot(location, what="a checkpoint", replace=force)


def snapshot(
    tree: Any, *, compression: str | None = None, buffers: _host.BufferPool | None = None
) -> Snapshot:
    """The blocking phase: plan ``tree``'s layout and copy this process's bytes to host.

    ``buffers`` (a manager's pool): every host byte is copied into buffers taken from
    it, CPU arrays included, and given back once written; without it, CPU arrays are
    held as zero-copy views (see :func:`_host_copy`) and other bytes go to fresh memory.
    """
    codec = _layout.check_codec(compression)
    with _tree.paused_gc():
        plan = _Plan.build(tree, codec=codec)
    plan.snapshot(buffers)
    _faults.kill_point("after_snapshot")
    return plan


# -- planning -----------------------------------------------------------------------


@dataclasses.dataclass
class _Leaf:
    index: int
    value: Any  # jax.Array / np.ndarray / None, after scalar and key conversion
    record: LeafRecord
    writes: list[tuple[tuple[slice, ...], np.ndarray]] = dataclasses.field(default_factory=list)


def _text(path: str, leaf: str | bytes) -> str:
    """A str or bytes leaf as the record's JSON string (bytes base64), bounded."""
    import base64

    raw = leaf.encode("utf-8") if isinstance(leaf, str) else leaf
    if len(raw) > _layout.MAX_TEXT_BYTES:
        raise StructureError(
            f"leaf {path!r}: a {type(leaf).__name__} of {len(raw)} bytes; str and bytes "
            f"leaves are kept in the metadata, at most {_layout.MAX_TEXT_BYTES} bytes each "
            f"(store larger data as a numpy uint8 array)"
        )
    return leaf if isinstance(leaf, str) else base64.b64encode(raw).decode("ascii")


def _classify(path: str, leaf: Any) -> tuple[str, Any, str | None]:
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


def _writer_process(value: Any) -> int:
    """Process that writes an unpartitioned leaf: the owner of replica 0."""
    if isinstance(value, jax.Array):
        return _first_device(value.sharding, value.shape).process_index
    return 0


def _is_partitioned(value: Any) -> bool:
    return isinstance(value, jax.Array) and not value.sharding.is_fully_replicated


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


class _Plan:
    """The layout of one save, identical on every process, plus this process's snapshot.

    After :meth:`snapshot` it is the :class:`Snapshot` handed to the background phase.
    """

    def __init__(self, leaves: list[_Leaf], batches: dict[str, BatchRecord]):
        self.leaves = leaves
        self.batches = batches
        self.batch_data: dict[str, np.ndarray | _chunk_files.Gathered] = {}
        self.digest = _digest(leaves)
        self._pool: _host.BufferPool | None = None
        self._pooled: list[np.ndarray] = []  # taken from _pool, given back after write

    @classmethod
    def build(cls, tree: Any, *, codec: str | None = None) -> _Plan:
        flat, _ = _tree.flatten(tree)
        leaves: list[_Leaf] = []
        sizes: dict[str, int] = {}  # batch name -> elements used so far
        kinds: dict[str, tuple[str, int, int]] = {}  # batch name -> (dtype, process, chunk)
        for index, (path, keys, raw) in enumerate(flat):
            kind, value, impl = _classify(path, raw)
            keys = tuple(keys)
            if kind in _layout.TEXT_KINDS:
                leaves.append(_Leaf(index, None, LeafRecord(path, keys, kind, value=value)))
                continue
            if kind in _layout.NO_DATA_KINDS:
                leaves.append(_Leaf(index, None, LeafRecord(path, keys, kind)))
                continue
            dtype = np.dtype(value.dtype)
            name = _layout.dtype_name(dtype)
            if name not in _layout.SUPPORTED_DTYPES:
                raise StructureError(
                    f"leaf {path!r}: expected a dtype in {sorted(_layout.SUPPORTED_DTYPES)}, "
                    f"found {dtype}"
                )
            shape = tuple(int(s) for s in value.shape)
            sharding = value.sharding if isinstance(value, jax.Array) else None
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes <= SMALL_LEAF_BYTES and not _is_partitioned(value):
                process = _writer_process(value)
                batch = _layout.batch_name(process, name)
                kinds.setdefault(
                    batch, (name, process, max(1, _arrays.BATCH_CHUNK_BYTES // dtype.itemsize))
                )
                size = nbytes // dtype.itemsize
                align = max(1, _host.ALIGNMENT // dtype.itemsize)  # zero-copy on restore
                offset = -(-sizes.get(batch, 0) // align) * align
                storage: Any = BatchStorage(batch, offset, size)
                sizes[batch] = offset + size
            else:
                shard_shape = sharding.shard_shape(shape) if sharding is not None else shape
                chunk = _arrays.chunk_shape(
                    shard_shape, dtype.itemsize, must_divide=_is_partitioned(value)
                )
                storage = ArrayStorage(tuple(chunk), codec)
            record = LeafRecord(
                path, keys, kind, shape, name, _metadata.describe_sharding(sharding), storage, impl
            )
            leaves.append(_Leaf(index, value, record))
        batches = {}
        for batch, (dtype, process, chunk) in kinds.items():
            size = max(1, sizes.get(batch, 0))
            # A small batch gets a chunk just big enough (a power of two): a full inner
            # chunk is stored even when the batch uses a few bytes of it.
            chunk = min(chunk, 1 << (size - 1).bit_length())
            batches[batch] = BatchRecord(batch, dtype, process, size, chunk, codec)
        return cls(leaves, batches)

    def snapshot(self, pool: _host.BufferPool | None = None) -> None:
        """Copies every byte this process writes to host memory (blocking phase); with
        ``pool``, into its buffers (given back by :meth:`write`)."""
        me = _distributed.process_index()
        self._pool = pool
        alloc = _host if pool is None else pool

        def pooled(buffer: np.ndarray) -> np.ndarray:  # given back after the write
            if pool is not None:
                self._pooled.append(buffer)
            return buffer

        # (leaf, what to read it from, region) for every piece this process writes; each
        # source is resolved once, so the object whose device-to-host copy is started
        # below is the one read afterwards (jax caches the copy per object).
        owned: list[tuple[_Leaf, Any, tuple | None]] = []
        for leaf in self.leaves:
            value, storage = leaf.value, leaf.record.storage
            if storage is None:
                continue
            if isinstance(storage, BatchStorage):
                if self.batches[storage.batch].process == me:
                    if isinstance(value, jax.Array):
                        value = _local_replica(value, None)
                    owned.append((leaf, value, None))
            elif isinstance(value, jax.Array):
                shape, chunk = leaf.record.shape, storage.chunk_shape
                for index, holders in _replica_groups(value.sharding, shape):
                    rows = _my_rows(index, shape, chunk, holders, me)
                    if rows is not None:
                        owned.append((leaf, (_local_replica(value, index), index), rows))
            elif me == 0:
                owned.append((leaf, value, tuple(slice(None) for _ in value.shape)))
        for _, source, _ in owned:  # start all device-to-host copies before waiting on any
            data = source[0] if isinstance(source, tuple) else source
            if isinstance(data, jax.Array) and next(iter(data.devices())).platform != "cpu":
                data.copy_to_host_async()
        # Small leaves: with a pool, copied into one pooled buffer per batch; otherwise
        # each leaf's own host snapshot (a zero-copy view on CPU, see _host_copy), and
        # the batch is written from those pieces (gathered, never copied on this thread).
        ends: dict[str, int] = {}  # end of the last leaf written into each batch
        pieces: dict[str, list[tuple[int, np.ndarray]]] = {}
        for name, batch in self.batches.items():
            if batch.process == me:
                dtype = _layout.dtype_from_name(batch.dtype)
                if pool is None:
                    pieces[name] = []
                else:
                    self.batch_data[name] = pooled(pool.empty((batch.size,), dtype))
                ends[name] = 0
        for leaf, source, rows in owned:
            storage = leaf.record.storage
            if isinstance(storage, BatchStorage):
                name = storage.batch
                off, size = storage.offset, storage.size
                if pool is None:
                    if isinstance(source, jax.Array):
                        host = _host_copy(source, None)
                    else:  # numpy or scalar: the caller may change it after we return
                        host = _host.copy(np.asarray(source))
                    pieces[name].append((off * host.dtype.itemsize, host))
                    continue
                buf = self.batch_data[name]
                buf[ends[name] : off] = 0  # alignment padding: never uninitialised memory
                buf[off : off + size] = np.asarray(source).reshape(-1)
                ends[name] = off + size
            elif isinstance(source, tuple):
                data, index = source
                part = _relative(rows, index)
                if pool is not None and data.device.platform == "cpu":
                    host = np.asarray(data)
                    leaf.writes.append(
                        (rows, pooled(pool.copy(host if part is None else host[part])))
                    )
                else:
                    leaf.writes.append((rows, _host_copy(data, part)))
            else:
                leaf.writes.append((rows, pooled(alloc.copy(np.asarray(source)))))
        for name, end in ends.items():
            if name in pieces:
                batch = self.batches[name]
                dtype = _layout.dtype_from_name(batch.dtype)
                self.batch_data[name] = _chunk_files.Gathered(pieces[name], dtype, batch.size)
            else:
                self.batch_data[name][end:] = 0
        for leaf in self.leaves:
            leaf.value = None  # the snapshot is all the background phase needs

    def document(self) -> CheckpointDocument:
        return CheckpointDocument(
            tuple(leaf.record for leaf in self.leaves),
            self.batches,
            _distributed.process_count(),
            time.time(),
            jax.__version__,
        )

    def write(
        self,
        location: Location,
        *,
        limit: int,
        durable: bool = True,
        reuse: _incremental.Reuse | None = None,
    ) -> _commit.Written:
        """Background phase: this process's chunks (and, on the primary, every zarr.json
        and ``_METADATA.json``); with ``durable``, made durable (one syncfs; a manager
        step syncs once for all its items instead). Commits nothing.

        ``reuse`` (a manager step with ``incremental=True``; local disk, or S3/GCS with
        a server-side copier; any number of processes, each calling this in the same
        order): every leaf stored as its own array gets a digest in ``_METADATA.json``
        (over every process's region hashes, exchanged first), and of one whose digest
        and layout equal the previous step's each process hard-links (local) or copies
        on the server (object stores) the chunks of its regions rather than writing
        them (see ``_incremental``)."""
        try:
            return self._write(location, limit=limit, durable=durable, reuse=reuse)
        finally:
            if self._pool is not None:  # tensorstore reads none of them any more
                self._pool.give_back(self._pooled)
            self._pooled = []

    def _write(self, location, *, limit, durable, reuse) -> _commit.Written:
        primary = _distributed.is_primary()
        files = {}
        links = {}
        if reuse is not None:
            links = self._plan_links(location, reuse)
        encoded: concurrent.futures.Future = concurrent.futures.Future()
        if primary:  # encoded while tensorstore's threads write the data
            threading.Thread(target=self._encode, args=(encoded,), daemon=True).start()
        written, reused = _write_data(location, self, primary, limit, links)
        if primary:
            encoded = encoded.result()
            location.write_bytes(METADATA_FILE, encoded, durable=False)
            files[METADATA_FILE] = _layout.sha256(encoded)
            _faults.kill_point("after_metadata")
        if durable:
            location.sync()
            _faults.kill_point("after_sync")
        return _commit.Written(written, files, reused)

    def _encode(self, out: concurrent.futures.Future) -> None:
        """``_METADATA.json``'s bytes (compact; the checksum is of these bytes)."""
        try:
            doc = self.document().to_json()
            out.set_result(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())
        except BaseException as e:  # noqa: BLE001  (raised by the write that needs it)
            out.set_exception(e)

    def _plan_links(self, location: Location, reuse: _incremental.Reuse) -> dict[int, Any]:
        """Records the digest of every array leaf (every process's region hashes, through
        the key-value store with several processes: every process calls this, in the
        same order); returns ``{leaf index: link()}`` for the leaves the previous step
        holds unchanged and of which this process writes regions (``link()`` links or
        copies this process's chunks of the leaf and returns the bytes reused, or None
        when it must write its regions after all); ``{}`` where this process reuses
        nothing (see :func:`_incremental.reuser`)."""
        reuse_leaf = _incremental.reuser(location)
        if reuse_leaf is None and _distributed.process_count() == 1:
            return {}
        arrays = [leaf for leaf in self.leaves if isinstance(leaf.record.storage, ArrayStorage)]
        mine: dict[int, list] | None = None
        try:
            mine = {
                leaf.index: _incremental.region_digests(leaf.record, leaf.writes)
                for leaf in arrays
                if leaf.writes
            }
        except Exception as e:  # noqa: BLE001  (no digest, no reuse; the save goes on)
            _incremental.logger.warning("incremental save: no digests recorded: %s", e)
        everyone = _incremental.exchange(reuse.op, mine)
        if everyone is None or mine is None:
            return {}
        for leaf in arrays:
            if everyone.get(leaf.index):
                digest = _incremental.leaf_digest(everyone[leaf.index])
                leaf.record = dataclasses.replace(leaf.record, digest=digest)
        if reuse_leaf is None:
            return {}
        previous = _incremental.previous_document(reuse)
        if previous is None:
            return {}
        source, doc = previous
        by_index = {leaf.index: leaf for leaf in self.leaves}
        records = {i: leaf.record for i, leaf in by_index.items()}
        links = {}
        for i, j in _incremental.plan_reuse(records, doc).items():
            leaf = by_index[i]
            chunks = _incremental.chunks_of(leaf.record, [b for b, _ in mine.get(i, ())])
            if not leaf.writes or chunks is None:
                continue
            nbytes = sum(data.nbytes for _, data in leaf.writes)
            links[i] = functools.partial(
                reuse_leaf,
                source,
                j,
                location,
                i,
                leaf.record,
                chunks=chunks,
                nbytes=nbytes,
                writes=leaf.writes,  # the snapshot, which each reused chunk must equal
            )
        return links


Snapshot = _Plan


def _digest(leaves: list[_Leaf]) -> str:
    """A digest of the tree's structure (paths, kinds, shapes, dtypes): equal on every
    process that saves the same tree."""
    h = hashlib.sha256()
    for leaf in leaves:
        r = leaf.record
        h.update(f"{r.path}\0{r.kind}\0{r.shape}\0{r.dtype}\n".encode())
        if r.value is not None:  # a str or bytes leaf: every process saves the same
            h.update(hashlib.sha256(r.value.encode("utf-8")).digest())
    return h.hexdigest()


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


def _array_spec(root: Location, index: int, record: LeafRecord) -> dict[str, Any]:
    dtype = _layout.dtype_from_name(record.dtype, path=record.path)
    return _arrays.spec(
        root,
        f"d/{int(index)}",
        record.shape,
        record.dtype,
        record.storage.chunk_shape,
        dtype.itemsize,
        codec=record.storage.codec,
    )


def _batch_inner(batch: BatchRecord) -> int:
    """Elements per checksummed inner chunk of a batch's files (divides its chunk)."""
    itemsize = _layout.dtype_from_name(batch.dtype).itemsize
    chunk = int(batch.chunk)
    inner = max(1, min(_arrays.BATCH_INNER_CHUNK_BYTES // itemsize, chunk))
    while chunk % inner:
        inner -= 1
    return inner


def _batch_spec(root: Location, batch: BatchRecord) -> dict[str, Any]:
    return _arrays.spec(
        root,
        f"b/{batch.name}",
        [batch.size],
        batch.dtype,
        [int(batch.chunk)],
        _layout.dtype_from_name(batch.dtype).itemsize,
        inner_chunk=[_batch_inner(batch)],
        codec=batch.codec,
    )


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
    import warnings

    cpu = jax.devices("cpu")[0]
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


_LEAVES_COPIED_AT_ONCE = 4  # object stores: leaves whose chunks are copied concurrently


def _write_data(
    staging: Location, plan: _Plan, primary: bool, limit: int, links: dict[int, Any]
) -> tuple[int, int]:
    """Writes this process's chunks (and, on the primary, every zarr.json), linking or
    copying the leaves in ``links`` instead where it can; returns (bytes written, bytes
    reused)."""
    pending: collections.deque = collections.deque()
    in_flight = 0
    written = 0
    reused = 0

    def drain(to: int) -> None:
        nonlocal in_flight
        while pending and in_flight > to:
            future, nbytes = pending.popleft()
            future.result()
            in_flight -= nbytes

    arrays = [
        (leaf, _array_spec(staging, leaf.index, leaf.record))
        for leaf in plan.leaves
        if isinstance(leaf.record.storage, ArrayStorage)
    ]
    batches = [(name, _batch_spec(staging, b)) for name, b in plan.batches.items()]
    if primary:
        creates = [_arrays.create(spec) for _, spec in arrays + batches]
        try:
            for future in creates:
                future.result()
        except BaseException:
            _settle((f, 0) for f in creates)  # none may recreate files after a cleanup
            raise
    # Links or server-side copies (after the zarr.json files exist: they go beside
    # them) run on helper threads (one on local disk; a few leaves at once on object
    # stores, where each waits on requests) while the changed leaves are written; a
    # leaf whose link or copy fails is written after them.
    linking = [(leaf, spec) for leaf, spec in arrays if leaf.index in links and leaf.writes]
    linker = None
    if linking:
        workers = 1 if staging.is_local else _LEAVES_COPIED_AT_ONCE
        linker = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fop-link")
        linked = [linker.submit(links[leaf.index]) for leaf, _ in linking]
    skip = {leaf.index for leaf, _ in linking}
    # Plain arrays and batches on local disk are written by ChunkWriter (no chunk-buffer
    # copy, writeback started per file); the rest, and any region it declines, by
    # tensorstore. Either way each write is one pending future, drained to ``limit``.
    writer = None
    if _chunk_files.usable(staging):
        writer = _chunk_files.ChunkWriter(staging.path)

    def direct_array(leaf: _Leaf):
        record = leaf.record
        return lambda index, data: writer.array(
            f"d/{leaf.index}", record.shape, record.storage.chunk_shape, index, data
        )

    def direct_batch(name: str):
        batch = plan.batches[name]
        return lambda index, data: writer.batch(f"b/{name}", batch.chunk, _batch_inner(batch), data)

    def array_job(leaf: _Leaf, spec):
        plain = writer is not None and leaf.record.storage.codec is None
        return spec, leaf.writes, direct_array(leaf) if plain else None

    jobs = [
        array_job(leaf, spec) for leaf, spec in arrays if leaf.writes and leaf.index not in skip
    ]
    for name, spec in batches:
        if name in plan.batch_data:
            data = plan.batch_data.pop(name)
            if writer is not None and plan.batches[name].codec is None:
                jobs.append((spec, [((slice(None),), data)], direct_batch(name)))
            else:
                if isinstance(data, _chunk_files.Gathered):
                    data = data.assemble()
                jobs.append((spec, [((slice(None),), data)], None))
    try:
        for round_ in range(2):
            if round_ == 1:  # the leaves whose links failed
                if linker is None:
                    break
                jobs = []
                for (leaf, spec), future in zip(linking, linked, strict=True):
                    nbytes = future.result()
                    if nbytes is None:
                        jobs.append(array_job(leaf, spec))
                    else:
                        reused += nbytes
                        leaf.writes.clear()  # drop the snapshot: the previous step has it
            for spec, writes, direct in jobs:
                store = None
                while writes:
                    index, data = writes.pop()
                    if data.size:
                        futures = direct(index, data) if direct is not None else None
                        if futures is None:
                            if store is None:
                                store = _arrays.open_for_write(spec)
                            write = store[index].write(
                                data, can_reference_source_data_indefinitely=True
                            )
                            futures = [write.commit]
                        share = data.nbytes // max(1, len(futures))
                        pending.extend((future, share) for future in futures)
                        in_flight += share * len(futures)
                        written += data.nbytes
                        if written == data.nbytes:
                            _faults.kill_point("mid_write")
                    del data
                    drain(limit)
        drain(0)
    except BaseException as e:
        _settle(pending)  # never leave writes in flight that recreate files
        if isinstance(e, ValueError):  # tensorstore's status text, with its whole spec
            text = str(e).split(" [tensorstore_spec=", 1)[0]
            raise CheckpointError(f"writing array data to {staging} failed: {text}") from e
        if isinstance(e, OSError) and writer is not None:
            raise CheckpointError(f"writing array data to {staging} failed: {e}") from e
        raise
    finally:
        if writer is not None:
            writer.close()
        if linker is not None:
            # No link or copy is made after a failure's cleanup: queued ones never start.
            linker.shutdown(wait=True, cancel_futures=True)
    return written, reused


def _settle(pending) -> None:
    """Waits for every future, ignoring their errors (the first error is the one raised)."""
    for future, _ in pending:
        try:
            future.result()
        except Exception:  # noqa: BLE001
            pass
