"""Saving a pytree: the blocking snapshot, then the background write and commit.

Call order, on every process (SPMD: all processes save the same tree structure in the
same order): :func:`snapshot` (the caller's thread) plans the layout (``plan``) and
copies this process's bytes to host (``host_snapshot``); from then on the caller may
donate or overwrite the saved arrays. :meth:`Snapshot.write` (a background thread)
writes the metadata and the data, in the request's format (``formats``), and makes
them durable; the caller
commits through ``commit``, once for a whole manager step, or once per
:func:`save_async`. Only one :func:`save_async` runs at a time in a process; a second
one waits for it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import env as _env
from .._base import host as _host
from .._base import interrupts as _interrupts
from .._base import tree as _tree
from .._base.regions import public
from .._format.layout import COMMIT_FILE, CommitMarker
from .._storage.kvstore import arguments, refusals
from .._storage.location import Location
from . import commit as _commit
from . import handle as _handle
from . import host_snapshot as _host_snapshot
from . import ownership as _ownership
from .formats import DEFAULT_FORMAT_VERSION, SaveRequest, check_save
from .handle import (
    Cancellation,
    SaveHandle,
    SaveResult,
    raise_if_cancelled,
)
from .plan import Plan, Snapshot, structure_lines

_IN_FLIGHT_LOCK = threading.Lock()  # one save_async starts at a time


@public("save", errors=refusals(arguments("path")))  # the region handed as ``region=``
def save(
    path: Any,
    tree: Any,
    *,
    region: _distributed.Region | None,
    force: bool = False,
    memory_limit_bytes: int | None = None,
    compression: str | None = None,
    format_version: int | None = DEFAULT_FORMAT_VERSION,
    data_file_bytes: int | None = None,
    host_memory_budget: int | None = None,
):
    """Saves ``tree`` to ``path``; durable and committed on return.

    See :func:`save_async` for the arguments.
    """
    given = {k: v for k, v in locals().items() if k not in ("path", "tree", "region")}
    return _save_async(path, tree, region, given).wait()


@public("save", errors=refusals(arguments("path")))
def save_async(
    path: Any,
    tree: Any,
    *,
    region: _distributed.Region | None,
    force: bool = False,
    memory_limit_bytes: int | None = None,
    compression: str | None = None,
    format_version: int | None = DEFAULT_FORMAT_VERSION,
    data_file_bytes: int | None = None,
    host_memory_budget: int | None = None,
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
      format_version: 2 (default, also None: each process packs its chunks into a few
        data files, see FORMAT.md) or 1 (one file per chunk; readable forever).
      data_file_bytes: version 2: the size a data file does not pass unless one chunk
        is larger (default 1 GiB on a filesystem, 256 MiB on an object store);
        refused with version 1.
      host_memory_budget: bytes of host memory the save may hold beyond the state
        itself (None: no bound). Accelerator arrays are copied on their devices (one
        more state of device memory until written) and to host in pieces as the
        writes complete (the blocking phase enqueues the device copies only). CPU
        arrays are written from their own memory before this returns (no copy at
        all; the blocking phase is then the data write). Small leaves (batched) are
        copied as usual. Both format versions stream; version 2 on an object store
        gathers each data file in memory before its upload, made smaller under a
        budget (docs/saving.md, section 3).

    Returns:
      A :class:`SaveHandle`; ``handle.wait()`` returns a :class:`SaveResult`.
    """
    given = {k: v for k, v in locals().items() if k not in ("path", "tree", "region")}
    return _save_async(path, tree, region, given)


def _save_async(path, tree, region: _distributed.Region | None, given: dict) -> SaveHandle:
    """:func:`save_async` in ``region`` (the caller's: drawn by the public function)."""
    # Every keyword option checked by its name, before anything waits or is written;
    # the modes (and the region) become one request, handed down from here.
    options = check_save(**given)
    force = options.pop("force")
    request = SaveRequest(region=region, **options)
    # Interrupted (Ctrl-C: held until the end of the blocking phase, see _start), the
    # save is cancelled: nothing staged is left, and the KeyboardInterrupt raised.
    started: list[SaveHandle] = []
    try:
        return _start(path, tree, started, request, force=force)
    except BaseException:
        for handle in started:
            handle.abandon()
        raise


def _start(
    path, tree, started: list[SaveHandle], request: SaveRequest, *, force: bool
) -> SaveHandle:
    """The blocking phase of :func:`save_async`; appends the handle to ``started`` as
    soon as its background phase runs."""
    with _IN_FLIGHT_LOCK:
        _host.wait_for_pending_save()  # interruptible: nothing of this save exists yet
        # Ctrl-C is held over the blocking phase proper (never raised inside a callback
        # of JAX or tensorstore, which would drop it) and raised at its end.
        with _interrupts.deferred_sigint():
            start = time.perf_counter()
            location = Location.from_path(path)
            cancelled = Cancellation()  # the writes stop once it is set
            snap = snapshot(tree, request.replace(cancelled=cancelled))
            # Refuses a foreign or (without ``force``) committed target. Object stores
            # write in place: remains of a dead save, or with ``force`` a checkpoint of
            # ours, are cleared first, in the background phase (the primary decides).
            region = request.region
            held = _ownership.prepare_slot(
                location, what="a checkpoint", replace=force, clear=False, region=region
            )
            clear_first = held and not location.supports_rename
            name = _distributed.unique_name(region=region)
            staging = _commit.Staging.begin(location, name, claim=False)
            job = _Background(
                location=location,
                snap=snap,
                staging=staging,
                op=_distributed.next_operation_id("save", region=region),
                region=region,
                clear_first=clear_first,
                force=force,
                start=start,
                blocking=time.perf_counter() - start,
                cancelled=cancelled,
                agreed={
                    "path": str(location),
                    "force": force,
                    "format_version": request.format_version,
                    "compression": request.compression,
                    "data_file_bytes": request.data_file_bytes,
                },
            )
            handle = SaveHandle(str(location), job.run, cancelled=cancelled, region=region)
            _host.in_flight(handle)
            handle.start()
            started.append(handle)
        wait_for_data(snap, handle)  # interruptible: the caller's except cancels
        return handle


@dataclasses.dataclass(frozen=True)
class _Background:
    """The background phase of one :func:`save_async`: clear (object stores), write,
    commit collectively. Runs on the handle's thread, in the save's ``region``."""

    location: Location
    snap: Snapshot
    staging: _commit.Staging
    op: str
    region: _distributed.Region | None
    clear_first: bool
    force: bool
    start: float
    blocking: float
    cancelled: threading.Event
    agreed: dict[str, Any]  # what every process must save with (commit_collectively)

    def run(self) -> SaveResult:
        location, staging = self.location, self.staging
        what = f"save to {location}"
        if self.clear_first:  # object store, no rename: start from an empty prefix
            if _distributed.is_primary():
                _ownership.remove(location, action="clear")
            _distributed.barrier(f"{self.op}/cleared", region=self.region)

        def write() -> _commit.Written:
            raise_if_cancelled(self.cancelled, what)
            _env.pause_point("before_claim")  # tests: two saves racing for one place
            staging.claim(fresh=not self.force)  # before any data: remains provably ours
            written = self.snap.write(staging.location)
            raise_if_cancelled(self.cancelled, what)
            return written

        def publish(files: dict[str, str]) -> None:
            raise_if_cancelled(self.cancelled, what)
            marker = CommitMarker(files, time.time()).to_bytes()
            staging.publish(COMMIT_FILE, marker, replace=self.force)

        written = _commit.commit_collectively(
            self.op,
            what=what,
            step=None,
            digest=self.snap.digest,
            write=write,
            publish=publish,
            abort=self.abort,
            agreed=self.agreed,
            structure=lambda: structure_lines(self.snap.leaves),
            region=self.region,
        )
        total = time.perf_counter() - self.start
        return SaveResult(str(location), self.blocking, total, written.bytes_written)

    def abort(self) -> None:
        """What the failed save wrote goes: its staging directory or, written in place
        on an object store, what it wrote there while our pending marker alone proves
        it (nothing committed; the primary, once every process stopped writing)."""
        self.staging.abort()
        if self.staging.renames or not _distributed.is_primary():
            return
        # Only under this save's own claim: a claim refused leaves the other writer's be.
        if _handle.holds_nonce(self.location, self.staging.nonce):
            _ownership.remove(self.location, action="remove the remains of the failed save at")


@public(errors=refusals(arguments("path")))
def is_committed(path: Any) -> bool:
    """True when ``path`` holds a committed standalone checkpoint. A store that
    answers "not there" for a bucket it lacks (S3 reads a missing bucket's key as
    missing) is listed before False is said: StoreAccessError for no such bucket."""
    location = Location.from_path(path)
    if location.exists(COMMIT_FILE):
        return True
    if not location.is_local:
        location.is_dir()  # a listing: a missing bucket or a refusal raises here
    return False


def wait_for_data(snap: Snapshot | None, handle: SaveHandle) -> None:
    """Blocks, for a save that holds views of the state under a host memory budget,
    until its data is written (or its background phase ended); returns at once for
    any other."""
    if snap is None or not snap.write_first:
        return
    while not snap.data_written.wait(0.05):
        if handle.done():
            return


def snapshot(tree: Any, request: SaveRequest) -> Snapshot:
    """The blocking phase: plan ``tree``'s layout and copy this process's bytes to host,
    as ``request`` says (its fields: :class:`SaveRequest`).

    ``request.buffers`` (a manager's pool; not under a host memory budget): every host
    byte is copied into buffers taken from it, CPU arrays included, and given back once
    written; without it, CPU arrays are held as zero-copy views and other bytes go to
    fresh memory. ``request.own_copy`` (a manager step in each host's own directory):
    this process writes everything it holds and every JSON file, ``_METADATA.json``
    dated ``request.created_at`` (the same bytes on every process).
    """
    with _tree.paused_gc():
        plan = Plan.build(tree, request)
    _env.pause_point("snapshot")
    snap = plan.snapshot()
    _env.kill_point("after_snapshot")
    return snap


def pool_sizes(like: Any, request: SaveRequest) -> list[int]:
    """The byte sizes of the pooled host buffers one save of a tree like ``like`` takes
    (its arrays, or ``jax.ShapeDtypeStruct`` leaves: ``jax.eval_shape`` of it), as
    ``request`` says; for ``BufferPool.reserve``. Reads no array data, allocates
    nothing. A ShapeDtypeStruct spread over several devices is refused (pass the state
    itself: its shards decide the regions)."""
    return _host_snapshot.pool_sizes(*_sizing_plan(like, request), own_copy=request.own_copy)


def _sizing_plan(like: Any, request: SaveRequest) -> tuple[list, dict]:
    def stand_in(path, x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = getattr(x, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1:
            raise ValueError(
                f"reserve: leaf {jax.tree_util.keystr(path)!r}: expected an array or a "
                f"ShapeDtypeStruct on one device, found one sharded over "
                f"{len(sharding.device_set)} devices (pass the state itself)"
            )
        return np.broadcast_to(np.zeros((), x.dtype), x.shape)  # no memory: stride 0

    tree = jax.tree_util.tree_map_with_path(stand_in, like)
    with _tree.paused_gc():
        plan = Plan.build(tree, request)
    return plan.leaves, plan.batches
