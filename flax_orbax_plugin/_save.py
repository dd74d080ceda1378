"""Saving a pytree: validation, host snapshot, background write, atomic commit.

Call order, on every process (SPMD: all processes call ``save_async`` with the
same tree structure in the same order):

1. Blocking phase, on the caller's thread: wait for the previous save (re-raise
   its unreported error), flatten and validate the tree, plan the layout, start
   every device-to-host copy and wait for them (one host copy of the bytes this
   process writes), then return a :class:`SaveHandle`. From here on the caller
   may donate or overwrite the saved arrays.
2. Background phase, on one non-daemon thread: the primary prepares the target,
   every process writes its own chunks through tensorstore within the host-memory
   budget and makes them durable (one syncfs), reports its status and meets at a
   barrier; the primary writes ``_METADATA.json`` and the ``_COMMITTED`` marker
   and renames the temporary sibling into place (local disk) or leaves the marker
   as the commit (object stores). A failure anywhere removes the temporary
   directory; earlier checkpoints are never touched.

Only one save runs at a time in a process; a second ``save_async`` waits for it
(saves started inside :func:`save_group` are one unit: their background phases
run back to back while the caller goes on).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import threading
import time
import uuid
from typing import Any

import jax
import numpy as np

from . import _arrays, _distributed, _faults, _host, _metadata, _tree
from ._errors import CheckpointError, StructureError
from ._metadata import COMMIT_FILE, METADATA_FILE
from ._storage import Location

SMALL_LEAF_BYTES = 1 << 20  # unpartitioned leaves up to this size are batched
DEFAULT_MEMORY_LIMIT_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """Figures of one finished save, as seen by this process."""

    path: str
    blocking_seconds: float
    total_seconds: float
    bytes_written: int  # array bytes this process wrote

    @property
    def gigabytes_per_second(self) -> float:
        return self.bytes_written / max(self.total_seconds, 1e-9) / 1e9


class SaveHandle:
    """A save whose background phase may still run. ``wait()`` re-raises its error.

    Thread-safety: ``wait`` and ``done`` may be called from any thread.
    """

    def __init__(self, location: Location, target: Any, after: SaveHandle | None = None):
        self.location = location
        self._after = after  # a save of the same group that must finish writing first
        self.path = str(location)
        self._target = target
        self._thread = threading.Thread(target=self._run, name="fop-save", daemon=False)
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._reported = False

    def _start(self) -> SaveHandle:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            if self._after is not None:
                self._after._thread.join()
                self._after = None
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


_IN_FLIGHT: list[SaveHandle] = []  # the latest save, or the saves of the latest group
_IN_FLIGHT_LOCK = threading.Lock()
_GROUP = threading.local()


def wait_for_pending_save(location: Location | None = None) -> None:
    """Waits for the in-flight save(s) (only if one targets ``location``, when given).

    Re-raises an error that ``wait()`` has not already reported.
    """
    handles = list(_IN_FLIGHT)
    if location is not None and all(h.location != location for h in handles):
        return
    for handle in handles:
        handle._thread.join()
    for handle in handles:
        if handle._error is not None and not handle._reported:
            handle._reported = True
            raise handle._error


@contextlib.contextmanager
def save_group():
    """Saves started inside this block (one thread) form one group: each runs its
    blocking phase at once, without waiting for the background phase of the others;
    their background phases run one after another, in call order.

    For callers that save several pytrees as one unit (the manager's checkpointables).
    The first save of a group still waits for saves started before the group.
    """
    if getattr(_GROUP, "handles", None) is not None:
        yield  # nested: part of the enclosing group
        return
    _GROUP.handles = []
    try:
        yield
    finally:
        _GROUP.handles = None


def save(path: Any, tree: Any, *, force: bool = False, memory_limit_bytes: int | None = None):
    """Saves ``tree`` to ``path``; durable and committed on return.

    See :func:`save_async` for the arguments.
    """
    return save_async(path, tree, force=force, memory_limit_bytes=memory_limit_bytes).wait()


def save_async(
    path: Any,
    tree: Any,
    *,
    force: bool = False,
    memory_limit_bytes: int | None = None,
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

    Returns:
      A :class:`SaveHandle`; ``handle.wait()`` returns a :class:`SaveResult`.
    """
    group = getattr(_GROUP, "handles", None)
    with _IN_FLIGHT_LOCK:
        if not group:
            wait_for_pending_save()
        start = time.perf_counter()
        location = Location.from_path(path)
        op = _distributed.next_operation_id("save")
        with _tree.paused_gc():
            plan = _Plan.build(tree)
        _check_target(location, force)
        plan.snapshot()
        _faults.kill_point("after_snapshot")
        nonce = _distributed.broadcast_str(f"{op}/nonce", uuid.uuid4().hex[:12])
        blocking = time.perf_counter() - start
        limit = memory_limit_bytes or DEFAULT_MEMORY_LIMIT_BYTES

        def background() -> SaveResult:
            written = _write_and_commit(location, plan, op, nonce, force, limit)
            return SaveResult(str(location), blocking, time.perf_counter() - start, written)

        handle = SaveHandle(location, background, after=group[-1] if group else None)
        if group is None:
            _IN_FLIGHT[:] = [handle]
        else:
            if not group:
                _IN_FLIGHT.clear()
            group.append(handle)
            _IN_FLIGHT.append(handle)
        return handle._start()


def is_committed(path: Any) -> bool:
    """True when ``path`` holds a committed checkpoint."""
    return Location.from_path(path).exists(COMMIT_FILE)


# -- planning -----------------------------------------------------------------------


@dataclasses.dataclass
class _Leaf:
    index: int
    kind: str
    value: Any  # jax.Array / np.ndarray / None, after scalar and key conversion
    record: dict[str, Any]
    writes: list[tuple[tuple[slice, ...], np.ndarray]] = dataclasses.field(default_factory=list)


def _classify(path: str, leaf: Any) -> tuple[str, Any, dict[str, Any]]:
    """(kind, array-like value, extra record fields) for one leaf; errors name the path."""
    if leaf is None:
        return "none", None, {}
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(leaf))
            return "prng_key", jax.random.key_data(leaf), {"impl": impl}
        return "array", leaf, {}
    if isinstance(leaf, bool):
        return "py_bool", np.asarray(leaf, dtype=np.bool_), {}
    if isinstance(leaf, int):
        if not -(2**63) <= leaf < 2**63:
            raise StructureError(f"leaf {path!r}: expected an int that fits int64, found {leaf}")
        return "py_int", np.asarray(leaf, dtype=np.int64), {}
    if isinstance(leaf, float):
        return "py_float", np.asarray(leaf, dtype=np.float64), {}
    if isinstance(leaf, complex):
        return "py_complex", np.asarray(leaf, dtype=np.complex128), {}
    if isinstance(leaf, np.generic):
        return "np_scalar", np.asarray(leaf), {}
    if isinstance(leaf, np.ndarray):
        return "array", leaf, {}
    raise StructureError(
        f"leaf {path!r}: expected a jax.Array, numpy array, scalar or None, "
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


def _replica0_source(value: jax.Array) -> jax.Array:
    """The single-device array holding replica 0 of an unpartitioned leaf."""
    if len(value.sharding.device_set) == 1:
        return value
    for shard in value.addressable_shards:
        if shard.replica_id == 0:
            return shard.data
    raise AssertionError("writer process holds no replica 0")


class _Plan:
    """The layout of one save, identical on every process, plus this process's snapshot."""

    def __init__(self, leaves: list[_Leaf], batches: dict[str, dict[str, Any]]):
        self.leaves = leaves
        self.batches = batches
        self.batch_buffers: dict[str, np.ndarray] = {}

    @classmethod
    def build(cls, tree: Any) -> _Plan:
        flat, _ = _tree.flatten(tree)
        leaves: list[_Leaf] = []
        batches: dict[str, dict[str, Any]] = {}
        for index, (path, keys, raw) in enumerate(flat):
            kind, value, extra = _classify(path, raw)
            record: dict[str, Any] = {"path": path, "keys": [list(k) for k in keys], "kind": kind}
            record.update(extra)
            if kind != "none":
                dtype = np.dtype(value.dtype)
                dtype_name = _metadata.dtype_name(dtype)
                if dtype_name not in _metadata.SUPPORTED_DTYPES:
                    raise StructureError(
                        f"leaf {path!r}: expected a dtype in {sorted(_metadata.SUPPORTED_DTYPES)}, "
                        f"found {dtype}"
                    )
                shape = tuple(int(s) for s in value.shape)
                record["shape"] = list(shape)
                record["dtype"] = dtype_name
                sharding = value.sharding if isinstance(value, jax.Array) else None
                record["sharding"] = _metadata.describe_sharding(sharding)
                nbytes = math.prod(shape) * dtype.itemsize
                if nbytes <= SMALL_LEAF_BYTES and not _is_partitioned(value):
                    process = _writer_process(value)
                    name = _metadata.batch_name(process, dtype_name)
                    batch = batches.setdefault(
                        name,
                        {
                            "dtype": dtype_name,
                            "process": process,
                            "size": 0,
                            "chunk": max(1, _arrays.BATCH_CHUNK_BYTES // dtype.itemsize),
                        },
                    )
                    size = nbytes // dtype.itemsize
                    align = max(1, _host.ALIGNMENT // dtype.itemsize)  # zero-copy on restore
                    offset = -(-batch["size"] // align) * align
                    record["storage"] = {
                        "type": "batch",
                        "batch": name,
                        "offset": offset,
                        "size": size,
                    }
                    batch["size"] = offset + size
                else:
                    shard_shape = sharding.shard_shape(shape) if sharding is not None else shape
                    chunk = _arrays.chunk_shape(
                        shard_shape, dtype.itemsize, must_divide=_is_partitioned(value)
                    )
                    record["storage"] = {"type": "array", "chunk_shape": chunk}
            leaves.append(_Leaf(index, kind, value, record))
        for batch in batches.values():
            batch["size"] = max(1, batch["size"])
        return cls(leaves, batches)

    def snapshot(self) -> None:
        """Copies every byte this process writes to host memory (blocking phase)."""
        me = _distributed.process_index()
        # (leaf, what to read it from, shard index) for every piece this process writes;
        # each source is resolved once, so the object whose device-to-host copy is
        # started below is the one read afterwards (jax caches the copy per object).
        owned: list[tuple[_Leaf, Any, tuple | None]] = []
        for leaf in self.leaves:
            if leaf.kind == "none":
                continue
            value = leaf.value
            storage = leaf.record["storage"]
            if storage["type"] == "batch":
                if self.batches[storage["batch"]]["process"] == me:
                    if isinstance(value, jax.Array):
                        value = _replica0_source(value)
                    owned.append((leaf, value, None))
            elif isinstance(value, jax.Array):
                for shard in value.addressable_shards:
                    if shard.replica_id == 0:
                        owned.append((leaf, shard.data, shard.index))
            elif me == 0:
                owned.append((leaf, value, tuple(slice(None) for _ in value.shape)))
        for _, source, _ in owned:  # start all device-to-host copies before waiting on any
            if isinstance(source, jax.Array) and next(iter(source.devices())).platform != "cpu":
                source.copy_to_host_async()
        ends: dict[str, int] = {}  # end of the last leaf written into each batch
        for name, batch in self.batches.items():
            if batch["process"] == me:
                dtype = _metadata.dtype_from_name(batch["dtype"])
                self.batch_buffers[name] = _host.empty((batch["size"],), dtype)
                ends[name] = 0
        for leaf, source, index in owned:
            storage = leaf.record["storage"]
            if storage["type"] == "batch":
                name = storage["batch"]
                buf = self.batch_buffers[name]
                off, size = storage["offset"], storage["size"]
                buf[ends[name] : off] = 0  # alignment padding: never uninitialised memory
                buf[off : off + size] = np.asarray(source).reshape(-1)
                ends[name] = off + size
            elif isinstance(source, jax.Array):
                leaf.writes.append((index, _host_copy(source)))
            else:
                leaf.writes.append((index, _host.copy(np.asarray(source))))
        for name, end in ends.items():
            self.batch_buffers[name][end:] = 0
        for leaf in self.leaves:
            leaf.value = None  # the snapshot is all the background phase needs

    def document(self) -> dict[str, Any]:
        return _metadata.new_document([leaf.record for leaf in self.leaves], self.batches)

    def array_specs(self, root: Location):
        for leaf in self.leaves:
            if leaf.kind != "none" and leaf.record["storage"]["type"] == "array":
                yield leaf, _array_spec(root, leaf.index, leaf.record)

    def batch_specs(self, root: Location):
        for name, batch in self.batches.items():
            yield name, _batch_spec(root, name, batch)


def _array_spec(root: Location, index: int, record: dict[str, Any]) -> dict[str, Any]:
    dtype = _metadata.dtype_from_name(record["dtype"], path=record["path"])
    return _arrays.spec(
        root,
        f"d/{int(index)}",
        record["shape"],
        record["dtype"],
        record["storage"]["chunk_shape"],
        dtype.itemsize,
    )


def _batch_spec(root: Location, name: str, batch: dict[str, Any]) -> dict[str, Any]:
    dtype = _metadata.dtype_from_name(batch["dtype"])
    chunk = int(batch["chunk"])
    inner = max(1, _arrays.BATCH_INNER_CHUNK_BYTES // dtype.itemsize)
    while chunk % inner:  # inner chunks must divide the chunk
        inner -= 1
    return _arrays.spec(
        root,
        f"b/{_metadata.batch_name(int(batch['process']), batch['dtype'])}",
        [batch["size"]],
        batch["dtype"],
        [chunk],
        dtype.itemsize,
        inner_chunk=[inner],
    )


def _host_copy(data: jax.Array) -> np.ndarray:
    """A host copy that no later donation or in-place update of ``data`` can change."""
    if data.device.platform == "cpu":
        return _host.copy(np.asarray(data))  # np.asarray alone would alias the device buffer
    return np.asarray(data)  # a fresh host buffer already


# -- background phase -------------------------------------------------------------------


def _check_target(location: Location, force: bool) -> None:
    # Every process looks (they share the store), so all refuse together rather than
    # the others waiting for a primary that raised.
    if not force and location.exists(COMMIT_FILE):
        raise CheckpointError(
            f"{location} already holds a committed checkpoint; pass force=True to replace it"
        )


def _staging(location: Location, nonce: str) -> Location:
    if location.supports_rename:
        return location.sibling(f"{location.name}.partial-{nonce}")
    return location


def _write_and_commit(
    location: Location, plan: _Plan, op: str, nonce: str, force: bool, limit: int
) -> int:
    staging = _staging(location, nonce)
    primary = _distributed.is_primary()
    if primary and not location.supports_rename:
        if force or location.is_dir():
            location.remove()  # no marker was there (checked), or force: start clean
    _distributed.barrier(f"{op}/prepared")
    # The primary encodes the metadata while tensorstore's threads write the data.
    encoded = concurrent.futures.Future()
    if primary:
        threading.Thread(target=_encode_document, args=(plan, encoded), daemon=True).start()
    error: BaseException | None = None
    written = 0
    try:
        written = _write_data(staging, plan, primary, limit)
        staging.sync()  # this process's chunks are durable before it reports "ok"
        _faults.kill_point("after_sync")
    except BaseException as e:  # noqa: BLE001  (reported to every process below)
        error = e
    status = "ok" if error is None else f"error: {type(error).__name__}: {error}"
    _distributed.publish(f"{op}/status", status)
    try:
        _distributed.barrier(f"{op}/written")
    except BaseException:
        if primary:  # a process is gone: nothing will commit, leave nothing behind
            staging.remove()
        raise
    if primary:
        statuses = (
            _distributed.gather_str(f"{op}/status")
            if _distributed.process_count() > 1
            else [status]
        )
        failed = [f"process {p}: {s}" for p, s in enumerate(statuses) if s != "ok"]
        outcome = "committed"
        if failed:
            outcome = "not committed; " + "; ".join(failed)
            staging.remove()
        else:
            try:
                _commit(location, staging, encoded.result(), nonce, force)
            except BaseException as e:  # noqa: BLE001
                staging.remove()
                error = error or e
                outcome = f"not committed; commit failed: {e}"
        _distributed.broadcast_str(f"{op}/outcome", outcome)
    else:
        outcome = _distributed.broadcast_str(f"{op}/outcome", None)
    _distributed.barrier(f"{op}/done")
    if error is not None:
        raise error
    if outcome != "committed":
        raise CheckpointError(f"save to {location} failed: {outcome}")
    return written


def _write_data(staging: Location, plan: _Plan, primary: bool, limit: int) -> int:
    """Writes this process's chunks (and, on the primary, every zarr.json)."""
    pending: collections.deque = collections.deque()
    in_flight = 0
    written = 0

    def drain(to: int) -> None:
        nonlocal in_flight
        while pending and in_flight > to:
            future, nbytes = pending.popleft()
            future.result()
            _faults.kill_point("mid_write")
            in_flight -= nbytes

    if primary:
        creates = [_arrays.create(spec) for _, spec in plan.array_specs(staging)]
        creates += [_arrays.create(spec) for _, spec in plan.batch_specs(staging)]
        for future in creates:
            future.result()
    jobs = [(spec, leaf.writes) for leaf, spec in plan.array_specs(staging) if leaf.writes]
    for name, spec in plan.batch_specs(staging):
        if name in plan.batch_buffers:
            full = (slice(None),)
            jobs.append((spec, [(full, plan.batch_buffers.pop(name))]))
    for spec, writes in jobs:
        store = _arrays.open_for_write(spec)
        while writes:
            index, data = writes.pop()
            if data.size:
                future = store[index].write(data, can_reference_source_data_indefinitely=True)
                pending.append((future.commit, data.nbytes))
                in_flight += data.nbytes
                written += data.nbytes
            del data
            drain(limit)
    drain(0)
    return written


def _encode_document(plan: _Plan, out: concurrent.futures.Future) -> None:
    try:
        out.set_result(json.dumps(plan.document(), separators=(",", ":")).encode("utf-8"))
    except BaseException as e:  # noqa: BLE001  (raised by the commit that needs it)
        out.set_exception(e)


def _commit(location: Location, staging: Location, document: bytes, nonce: str, force: bool):
    """Primary only: metadata, marker last, then the atomic rename on local disk."""
    staging.write_bytes(METADATA_FILE, document)
    _faults.kill_point("after_metadata")
    staging.write_json(COMMIT_FILE, {"committed_at": time.time()})
    _faults.kill_point("after_marker")
    if not location.supports_rename:
        return
    old = None
    if location.is_dir():
        if not force and location.exists(COMMIT_FILE):
            raise CheckpointError(f"{location} was committed by someone else meanwhile")
        old = location.sibling(f"{location.name}.old-{nonce}")
        location.rename(old)
        _faults.kill_point("mid_rename")
    staging.rename(location)
    if old is not None:
        old.remove()
