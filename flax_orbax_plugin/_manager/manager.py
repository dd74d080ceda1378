"""CheckpointManager: a directory of training steps.

Layout (see FORMAT.md and ``_steps``)::

    <directory>/
      .writer.lock                 flock held by the one live writer (local only)
      <step>/                      committed step
        _CHECKPOINT.json           manifest: items, checksums of the JSON files; the commit
        params/ opt_state/ ...     one pytree (or JSON) per checkpointable
      <step>.partial-<nonce>/      a step being written (local); removed on open
      <step>.deleting-<nonce>/     a step being deleted (local); removed on open
      <step>.corrupt-<nonce>/      a step that failed verification on resume; kept

One step, one commit: every item is written into the step's staging directory without
a commit of its own; when every process has made its files durable, the primary
writes the manifest and commits the step once (``_commit``: rename on filesystems,
the manifest as the marker on object stores).

Threading and call order. One training thread owns a manager: it calls ``save`` /
``restore`` / ``wait`` / ``close``. ``save`` runs the blocking phase of each item on
the calling thread (device-to-host snapshot, iterator state, JSON encoding), then
hands the writes and the commit to one background thread (a :class:`SaveHandle`); at
most one save is in flight, and ``save`` waits for the previous one before starting
another. Retention then runs on a deletion thread. An error from the background is
re-raised by the next ``save``, ``wait``, ``restore`` or ``close``; never dropped.

Multi-process (``jax.process_count() > 1``): every process calls ``save``,
``restore``, ``wait`` and ``close`` with the same arguments in the same order. A
time-based save decision is taken by the primary and shared, so all processes save
the same steps. Each process writes its own shards and data-iterator state; a step
commits only when every process reported the same step and tree structure.
"""

from __future__ import annotations

import bisect
import collections
import logging
import operator
import os
import secrets
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._base import distributed as _distributed
from .._base import faults as _faults
from .._base import host as _host
from .._core import commit as _commit
from .._core import ownership as _ownership
from .._core.commit import Staging, Written
from .._core.save import SaveHandle, SaveResult
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
    StepDeletedError,
    StructureError,
    UnknownItemError,
)
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import MANIFEST_FILE, ItemEntry, StepManifest
from .._incremental import reuse as _incremental
from .._incremental.reuse import Reuse
from .._like import transform as _transform
from .._state.resume import item_mismatch
from .._state.train_state import merge_state, split_state
from .._storage import shared_dir as _shared_dir
from .._storage.location import Location
from .._storage.lock import DirectoryLock
from . import options as _options
from .checkpointables import Checkpointable, Pending, PytreeCheckpointable, checkpointable_for
from .policy import SavePolicy
from .preemption import Preemption
from .retention import RetentionPolicy, steps_to_delete
from .tiers import PersistentTier

__all__ = ["CheckpointManager"]

logger = logging.getLogger("flax_orbax_plugin")


def _check_item_name(name: Any) -> str:
    if not _layout.is_safe_name(name):
        raise ValueError(
            f"invalid checkpointable name {name!r}: use letters, digits, '_', '-', '.' "
            "and do not start with '_' or '.'"
        )
    return name


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of warnings.warn (called from this module) that names the
    first frame outside this package: the user's call."""
    import sys

    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while (
        frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == package
    ):
        frame, level = frame.f_back, level + 1
    return level


def _manager_option_names() -> tuple[str, ...]:
    import inspect

    params = inspect.signature(CheckpointManager.__init__).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


class CheckpointManager:
    """A directory of training steps: save policy, retention, async saves, restore.

    Args (all keyword-only after ``directory``):
      directory: local path, ``s3://`` / ``gs://`` URL, or tensorstore kvstore spec.
      keep: keep the last ``keep`` steps (None: no limit from this rule).
      keep_every: also keep every step divisible by ``keep_every``, forever.
      keep_best, best_metric, best_mode: also keep the ``keep_best`` steps with the
        best ``extras[best_metric]`` ("min" or "max").
      every_steps, every_seconds, steps: the save policy; with none of them every
        ``save`` call writes. ``save(force=True)`` always does.
      async_save: when False, ``save`` returns once the step is committed.
      read_only: take no lock, remove nothing, refuse ``save``; for evaluators
        reading a directory while training writes to it.
      handle_sigterm: on SIGTERM, the next ``save`` call saves its step whatever
        the policy, waits for it, closes the manager and raises SystemExit(143).
        One process: a handler installed from the main thread. Several processes
        (jax.distributed): jax's own notifier is kept, a notice on any host reaches
        every host, and every process saves the same agreed step (at most a step or
        so after the notice); call ``save`` (or ``should_save``) at every step, on
        every process, for it to be found. See ``_preemption``.
      checkpointables: overrides of the checkpointable used per item name.
      incremental: a pytree leaf unchanged since the previous committed step (equal
        layout, and equal bytes in an equal split into the regions each process
        writes: any sharding, any number of processes) is hard-linked from it (local
        disk) or copied on the server (S3, GCS), not written; each process reuses
        the chunks of its own regions. With several processes the region hashes go
        through the jax.distributed key-value store first (one value per process and
        item, deleted after the commit). See _incremental.
      compression: per pytree item, ``"zstd"`` or ``"zstd:<level>"``, e.g.
        ``{"opt_state": "zstd"}``; restore reads the codec from the checkpoint.
      clock: time source for ``every_seconds`` (tests pass one in).
      persistent: a second, persistent tier (``s3://``, ``gs://``, a shared
        filesystem path) to which every step committed in ``directory`` (then a
        local disk) is replicated in the background, with its own commit; restore
        takes the newest good step of either tier. See ``_tiers``.
      persistent_keep, persistent_keep_every: the persistent tier's retention (as
        ``keep`` and ``keep_every``; ``persistent_keep=None`` keeps every step there).
      persistent_grace_seconds: after SIGTERM, how long the exit waits for the
        replication of the step it saved.
      persistent_lease_seconds: one run owns its places: a second live manager on the
        persistent path is refused (a lock on filesystems; on object stores a lease of
        this many seconds, renewed every third of it). See ``_run_owner``.
      reuse_host_buffers: copy the state in the blocking phase into host buffers kept
        from the previous save (one host copy of the saved state then stays allocated
        between saves, until ``close``). Off (the default): CPU arrays are held as
        zero-copy views until written (a blocking phase of milliseconds), and a step
        that donates its state meanwhile allocates fresh outputs. On helps where fresh
        memory is dear (first touch of a VM's memory was measured 10x costlier than
        memory freed earlier: the step after a save took 2.7 s against 1.0 s pooled);
        in the steady state of a loop whose retention deletes old steps both measured
        alike here (``benchmarks/train_loop.py``).

    ``wait()`` is for the local tier; ``persistent.wait()`` waits for the replication
    (``close()`` waits for both).

    A writer (``read_only=False``) takes an exclusive lock on a local directory
    (a second live writer gets DirectoryLockedError; a SIGKILLed writer's lock is
    released by the kernel) and removes unfinished temporary steps. A directory that
    is itself a step or a core checkpoint is refused.
    """

    def __init__(
        self,
        directory: Any,
        *,
        keep: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        every_steps: int | None = None,
        every_seconds: float | None = None,
        steps: Iterable[int] | None = None,
        async_save: bool = True,
        read_only: bool = False,
        handle_sigterm: bool = False,
        checkpointables: Mapping[str, Checkpointable] | None = None,
        clock: Callable[[], float] = time.monotonic,
        incremental: bool = False,
        compression: Mapping[str, str] | None = None,
        persistent: Any = None,
        persistent_keep: int | None = None,
        persistent_keep_every: int | None = None,
        persistent_grace_seconds: float = 30.0,
        persistent_lease_seconds: float = 60.0,
        reuse_host_buffers: bool = False,
        **unknown: Any,
    ):
        _options.check_unknown("CheckpointManager", unknown, _MANAGER_OPTIONS)
        _options.check_manager(locals())
        steps = _options.steps_list("steps", steps)
        self._loc = Location.from_path(directory)
        self._retention = RetentionPolicy(
            keep_last=keep,
            keep_every=keep_every,
            keep_best=keep_best,
            best_metric=best_metric,
            best_mode=best_mode,
        )
        self._policy = SavePolicy(every_steps=every_steps, every_seconds=every_seconds, steps=steps)
        self._clock = clock
        self._async = async_save
        self._read_only = read_only
        self._overrides = dict(checkpointables or {})
        for name, codec in (compression or {}).items():
            if name in self._overrides:
                raise ValueError(f"compression[{name!r}]: item {name!r} has its own checkpointable")
            self._overrides[_check_item_name(name)] = PytreeCheckpointable(
                compression=_layout.check_codec(codec, where=f"compression[{name!r}]")
            )
        self._incremental = incremental
        # Snapshot memory kept from one save to the next (see _host.BufferPool).
        self._buffers = _host.BufferPool() if reuse_host_buffers else None
        self._lock = threading.Lock()  # guards the fields below
        self._reading: collections.Counter[int] = collections.Counter()
        self._deleting: set[int] = set()
        self._metrics: dict[int, float | None] = {}
        self._inflight: SaveHandle | None = None
        self._committed: list[int] | None = None  # a writer's committed steps (steps())
        self._last_save: SaveResult | None = None
        self._retention_future: Future | None = None
        self._closed = False
        self._preemption: Preemption | None = None  # handle_sigterm (see _preemption)
        self.restored_step: int | None = None  # the step the last restore() read
        self._warned_replay = False  # warned that a resume left the data position out
        # The one line logged per committed step (a callback with a metric writer, which
        # reports the same figures, lowers it to DEBUG: one line per save).
        self.commit_log_level = logging.INFO
        self._dir_lock: DirectoryLock | None = None
        self._delete_pool: ThreadPoolExecutor | None = None
        self._tier: PersistentTier | None = None
        self._refuse_step_directory()
        if read_only:
            if handle_sigterm:
                raise ValueError("handle_sigterm needs a writer (read_only=False)")
            if persistent is not None:
                raise ValueError(
                    "persistent= needs a writer; to read the persistent tier, open it "
                    "directly: CheckpointManager(<persistent location>, read_only=True)"
                )
            return
        self._open_writer()
        try:  # several processes on a local path: the same directory on every host
            _shared_dir.check_visible(self._loc)
        except BaseException:
            self.close()
            raise
        if persistent is not None:
            try:
                self._tier = PersistentTier(
                    self._loc,
                    persistent,
                    keep=persistent_keep,
                    keep_every=persistent_keep_every,
                    grace_seconds=persistent_grace_seconds,
                    remove_step=remove_step,
                    busy=lambda: self.save_in_flight,
                    lease_seconds=persistent_lease_seconds,
                )
                self._tier.open(self.steps())
            except BaseException:
                self.close()
                raise
        if handle_sigterm:
            try:
                self._preemption = Preemption.install()
            except BaseException:
                self.close()
                raise

    def _refuse_step_directory(self) -> None:
        path = self._loc.path.rstrip("/")
        if self._loc.is_local and os.path.lexists(path) and not os.path.isdir(path):
            raise CheckpointError(
                f"{self._loc} is a file, not a directory of steps"
                + _steps.foreign_format_hint(self._loc)
            )
        for marker, what in (
            (MANIFEST_FILE, "a committed step"),
            (_layout.COMMIT_FILE, "a core checkpoint"),
            (_layout.METADATA_FILE, "a core checkpoint"),
        ):
            if self._loc.exists(marker):
                raise CheckpointError(
                    f"{self._loc} is itself {what} (it holds {marker}), not a directory of "
                    f"steps; give the directory that holds the steps"
                )

    def _open_writer(self) -> None:
        if self._loc.is_local and _distributed.is_primary():
            # One writer per directory: the primary holds the lock for all processes
            # of a run (the others write only through the primary's commit protocol).
            self._loc.makedirs()
            self._dir_lock = DirectoryLock(self._loc.path)
            self._dir_lock.acquire()
        try:
            if _distributed.is_primary():
                self._remove_unfinished()
            _distributed.session_nonce()  # collective once; later staging names need none
            _distributed.barrier(_distributed.next_operation_id("manager-open"))
        except BaseException:
            self._release_lock()
            raise
        self._delete_pool = ThreadPoolExecutor(1, thread_name_prefix="fop-retention")

    # ------------------------------------------------------------------ listing

    @property
    def directory(self) -> str:
        return str(self._loc)

    def steps(self) -> list[int]:
        """Committed steps, ascending (steps being deleted are left out), as listed in
        the store now. A save never calls it: see :meth:`_known_steps`."""
        steps = _steps.committed_steps(self._loc)
        with self._lock:
            return [s for s in steps if s not in self._deleting]

    def _known_steps(self) -> list[int]:
        """A writer's committed steps, from its list in memory (steps being deleted left
        out): what ``save`` and retention use, so that a save costs the same whatever
        the number of steps kept. Listed from the store at the first need and again
        after a failed commit (or anything else that makes it unsure); kept up to date
        by this manager's own commits and removals. Any thread."""
        with self._lock:
            known = self._committed
        if known is None:
            listed = _steps.committed_steps(self._loc)
            with self._lock:
                if self._committed is None:
                    self._committed = listed
                known = self._committed
        with self._lock:
            return [s for s in known if s not in self._deleting]

    def _forget_steps(self) -> None:
        """The list in memory may be wrong (a failed commit, a removal by someone
        else, a copy from the persistent tier): the next need lists the store."""
        with self._lock:
            self._committed = None

    def _step_committed(self, step: int) -> None:
        with self._lock:
            if self._committed is not None and step not in self._committed:
                bisect.insort(self._committed, step)

    def _step_removed(self, step: int) -> None:
        with self._lock:
            if self._committed is not None and step in self._committed:
                self._committed.remove(step)

    def latest_step(self, *, include_persistent: bool = False) -> int | None:
        """The highest committed step, or None when there is none; with
        ``include_persistent``, of either tier (what ``restore()`` starts from)."""
        steps = self.steps()
        if include_persistent and self._tier is not None:
            steps = sorted(set(steps) | set(self._tier.steps()))
        return steps[-1] if steps else None

    @property
    def persistent(self) -> PersistentTier | None:
        """The persistent tier (``persistent=``), or None."""
        return self._tier

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``handle_sigterm=True``); with several
        processes, once the step every process saves before stopping was reached."""
        return self._preemption is not None and self._preemption.notified

    def _preempted_at(self, step: int) -> bool:
        """Whether ``step`` is to be saved before stopping (``handle_sigterm``). With
        several processes it asks jax's preemption sync manager: every process must
        ask for every step, in order (``should_save`` or ``save`` once per step)."""
        return self._preemption is not None and self._preemption.reached(step)

    # ------------------------------------------------------------------ save

    def should_save(self, step: int, *, t: float | None = None) -> bool:
        """Whether the policy asks for ``step`` (this process's view; ``save`` shares the
        primary's time-based decision with every process)."""
        step = operator.index(step)
        return self._preempted_at(step) or self._policy.should_save(step, self._now(t))

    def save(
        self,
        step: int,
        state: Any = None,
        *,
        data_iterator: Any = None,
        extras: Mapping[str, Any] | None = None,
        force: bool = False,
        overwrite: bool = False,
        t: float | None = None,
    ) -> bool:
        """Save ``state`` as ``step`` if the policy says so; return whether it saved.

        ``state`` is split into checkpointables (see ``_train_state``): a Flax
        TrainState, NNX module/optimizer, or a dict of items. ``data_iterator``'s
        state and the JSON ``extras`` become items too. ``force`` saves whatever the
        policy says. A step at or below the latest committed one is refused unless
        ``overwrite=True`` (which replaces an existing step atomically). ``t`` is the
        time for ``every_seconds`` (default: the manager's clock). ``extras`` may be a
        callable returning the mapping, called only when the step is saved.

        Returns once every item's blocking phase is done (state may then be mutated
        or donated); the write completes in the background unless ``async_save=False``.
        Call from the training thread only; with several processes, on every process.
        """
        self._check_writable()
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, found {step}")
        preempted = self._preempted_at(step)  # first: asked at every step, in order
        self._raise_background_error()
        if not (force or preempted or self._decide(step, t)):
            return False
        self._wait_inflight()
        local = self._check_new_step(step, overwrite or preempted)
        if callable(extras):  # computed only for a step that is saved
            extras = extras()
        items = self._collect_items(state, data_iterator, extras)
        self._inflight = self._start_save(step, items, extras, local)
        self._policy.record_save(self._now(t))
        if not self._async or preempted:
            self._wait_inflight()
        if preempted:
            self.close()
            raise SystemExit(128 + signal.SIGTERM)
        return True

    def _now(self, t: float | None) -> float:
        return self._clock() if t is None else float(t)

    def _decide(self, step: int, t: float | None) -> bool:
        """The policy's decision; a time-based one is the primary's, shared by all."""
        decide = self._policy.should_save(step, self._now(t))
        if self._policy.every_seconds is not None and _distributed.process_count() > 1:
            op = _distributed.next_operation_id("manager-policy")
            decide = _distributed.broadcast_str(op, str(int(decide))) == "1"
        return decide

    def _check_new_step(self, step: int, overwrite: bool) -> list[int]:
        """Refuses a step at or below the latest committed one unless ``overwrite``;
        returns the committed local steps (from memory: no listing per save)."""
        local = self._known_steps()
        if step not in local:  # a foreign entry with the step's name is never replaced
            self._check_slot(step)
        # Steps increase across both tiers (the persistent one as known, not listed).
        steps = sorted(set(local) | self._tier.known_steps()) if self._tier else local
        if steps and step <= steps[-1] and not overwrite:
            what = "already exists" if step in steps else "is below the latest committed step"
            where = self._loc if steps == local else f"{self._loc} + {self._tier.remote}"
            raise CheckpointError(
                f"step {step} {what} in {where} (latest: {steps[-1]}); steps must "
                f"increase. Resume from it (resume=True), use a new directory, or pass "
                f"overwrite=True to replace steps"
            )
        return local

    def _check_slot(self, step: int) -> None:
        """Refuses a step whose name a foreign entry holds; clears a dead save's remains.

        On an object store with several processes, every process writes into the step's
        own prefix (no staging name), so a fast process's data could land before a
        slower primary looks: the primary alone looks, before anyone writes, and every
        process waits for its verdict (one key-value round, only for a new step)."""
        slot = _steps.step_location(self._loc, step)

        def look() -> None:
            if _ownership.check_slot(slot, what=f"step {step}", replace=False):
                _ownership.remove(slot, action="clear the remains of a dead save at")

        if self._loc.supports_rename or _distributed.process_count() == 1:
            look()
            return
        op = _distributed.next_operation_id("manager-slot")
        verdict = ""
        if _distributed.is_primary():
            try:
                look()
            except CheckpointError as e:
                verdict = f"{type(e).__name__}: {e}"
        verdict = _distributed.broadcast_str(op, verdict)
        if verdict:
            kind, _, message = verdict.partition(": ")
            raise (ForeignEntryError if kind == "ForeignEntryError" else CheckpointError)(
                f"{message} (checked by process 0)"
            )

    def _collect_items(self, state: Any, data_iterator: Any, extras: Any) -> dict[str, Any]:
        items = split_state(state)
        for name, value in (("data_iterator", data_iterator), ("extras", extras)):
            if value is not None:
                if name in items:
                    raise ValueError(f"{name} given twice: in state and as an argument")
                items[name] = value
        if not items:
            raise ValueError("nothing to save: state, data_iterator and extras are all empty")
        for name in items:
            _check_item_name(name)
        return items

    def _start_save(self, step: int, items: dict, extras: Any, local: list[int]) -> SaveHandle:
        """Blocking phase of every item, then the background write and commit.
        ``local``: the committed local steps (``step`` among them: it is replaced)."""
        started = time.perf_counter()
        replace = step in local
        final = _steps.step_location(self._loc, step)
        staging = Staging.begin(final, _distributed.unique_name())
        # On object stores a replaced step's items go under fresh names (old step intact).
        dirs = {n: n if staging.renames or not replace else f"{n}.{staging.nonce}" for n in items}
        handlers = {name: checkpointable_for(name, self._overrides) for name in items}
        pendings: dict[str, Pending] = {}
        reuses: list[Reuse] = []  # their key-value values are deleted after the commit
        prev = max((s for s in local if s < step), default=None) if self._incremental else None
        prev_loc = None if prev is None else _steps.step_location(self._loc, prev)
        try:
            for name, value in items.items():
                kw = {}  # incremental: the same item of the previous step, to reuse from
                if isinstance(handlers[name], PytreeCheckpointable):
                    kw = {"buffers": self._buffers}
                    if self._incremental:  # the exchange's name: drawn here, in item order
                        reuse_op = _distributed.next_operation_id("reuse")
                        kw["reuse"] = Reuse(prev_loc, name, reuse_op)
                        reuses.append(kw["reuse"])
                target = staging.location.child(dirs[name])
                pendings[name] = handlers[name].save(target, value, **kw)
        except BaseException:
            _wait_all(pendings.values())
            if staging.renames:
                _ownership.remove_staging(staging.location, staging.nonce)
            raise
        entries = {n: ItemEntry(getattr(h, "kind", "custom"), dirs[n]) for n, h in handlers.items()}
        digest = _layout.sha256(
            _layout.encode(
                [[n, entries[n].kind, getattr(p, "digest", "")] for n, p in pendings.items()]
            )
        )
        metric = self._metric_of(extras)
        blocking = time.perf_counter() - started
        op = _distributed.next_operation_id("manager-commit")

        def background() -> SaveResult:
            try:
                written = self._commit(op, step, staging, pendings, entries, digest, replace)
            except BaseException:
                self._forget_steps()  # a failed commit never enters the list; re-read
                raise
            finally:  # every process has read every exchanged value by now
                _incremental.release(reuses)
            result = SaveResult(
                str(final),
                blocking,
                time.perf_counter() - started,
                written.bytes_written,
                step,
                written.bytes_reused,
            )
            self._after_commit(step, result, metric)
            return result

        return SaveHandle(str(final), background).start()

    def _commit(self, op, step, staging: Staging, pendings, entries, digest, replace) -> Written:
        """Background thread: every item written and durable, then the one commit."""

        sizes: list[Written] = []  # this process's totals, for the manifest
        old_dirs: set[str] = set()  # object stores: the replaced step's item directories
        if replace and not staging.renames and _distributed.is_primary():
            old = _steps.read_manifest(staging.final)
            old_dirs = {e.dir for e in old.items.values()}

        def write() -> Written:
            total, files, reused = 0, {}, 0
            results = _wait_all(pendings.values(), raise_first=True)
            for name, result in zip(pendings, results, strict=True):
                if isinstance(result, Written):
                    total += result.bytes_written
                    reused += result.bytes_reused
                    files.update({f"{entries[name].dir}/{f}": h for f, h in result.files.items()})
            staging.location.sync()
            _faults.kill_point("after_sync")
            sizes.append(Written(total, files, reused))
            return sizes[-1]

        def publish(files: dict[str, str]) -> None:
            count = _distributed.process_count()
            # Sizes only where this process wrote it all (others' totals are not here).
            mine = sizes[0] if count == 1 and sizes else None
            manifest = StepManifest(
                step,
                entries,
                files,
                count,
                time.time(),
                digest,
                None if mine is None else mine.bytes_written,
                None if mine is None else mine.bytes_reused,
            )
            staging.publish(MANIFEST_FILE, manifest.to_bytes(), replace=True)
            if not staging.renames and old_dirs:
                fresh = {e.dir for e in entries.values()}
                _ownership.remove_children(  # the replaced step's own item directories
                    staging.final, sorted(old_dirs - fresh), action="clean up the replaced"
                )

        def abort() -> None:
            if staging.renames:
                _ownership.remove_staging(staging.location, staging.nonce)
            elif not replace:  # a new step written in place: no manifest, all of it goes
                _ownership.remove_if_ours(staging.final, what="uncommitted step")
            else:  # the old step stays whole: only the new items' fresh directories go
                fresh = [e.dir for n, e in entries.items() if e.dir != n]
                _ownership.remove_children(staging.final, fresh, action="abort the save into")

        return _commit.commit_collectively(
            op,
            what=f"step {step} of {self._loc}",
            step=step,
            digest=digest,
            write=write,
            publish=publish,
            abort=abort,
        )

    def _after_commit(self, step: int, result: SaveResult, metric: float | None) -> None:
        self._step_committed(step)
        with self._lock:
            self._metrics[step] = metric
            self._last_save = result
        logger.log(
            self.commit_log_level,
            "checkpoint: committed step %d: blocking %.4f s, total %.4f s, %d bytes, %.3f GB/s",
            step,
            result.blocking_seconds,
            result.total_seconds,
            result.bytes_written,
            result.gigabytes_per_second,
        )
        if self._tier is not None:
            self._tier.submit(step)
        if self._delete_pool is not None:
            self._retention_future = self._delete_pool.submit(self._apply_retention, step)

    def _metric_of(self, extras: Any) -> float | None:
        if self._retention.best_metric is None or not isinstance(extras, Mapping):
            return None
        return _as_metric(extras.get(self._retention.best_metric))

    # ------------------------------------------------------------------ retention

    def _metric(self, step: int) -> float | None:
        with self._lock:
            if step in self._metrics:
                return self._metrics[step]
        value = None
        name = self._retention.best_metric
        try:
            step_loc = _steps.step_location(self._loc, step)
            entry = _steps.read_manifest(step_loc).items.get("extras")
            if entry is not None:
                extras = checkpointable_for("extras", self._overrides).restore(
                    step_loc.child(entry.dir), None
                )
                if isinstance(extras, Mapping):
                    value = _as_metric(extras.get(name))
        except CheckpointError as e:
            logger.warning("retention: cannot read metric of step %d: %s", step, e)
        with self._lock:
            self._metrics[step] = value
        return value

    def gc(self) -> list[int]:
        """Removes unfinished steps and applies retention now; returns the removed steps.

        Call from the training thread (waits for the in-flight save first).
        """
        self._check_writable()
        self.wait()
        self._forget_steps()  # gc looks at the store itself
        if _distributed.is_primary():
            self._remove_unfinished()
        return self._apply_retention(None)

    def _apply_retention(self, just_written: int | None) -> list[int]:
        """Deletion thread: delete the steps the retention policy does not keep (the
        primary); the other processes drop the same steps from their list in memory."""
        removed: list[int] = []
        try:
            if not self._retention.deletes_anything:
                return removed
            steps = self._known_steps()
            metrics = {}
            if self._retention.keep_best is not None:
                metrics = {s: self._metric(s) for s in steps}
                metrics = {s: m for s, m in metrics.items() if m is not None}
            with self._lock:
                protected = {just_written} - {None} | set(+self._reading)
            if self._tier is not None:  # not yet replicated: kept locally
                protected |= self._tier.pending_steps()
            doomed = steps_to_delete(steps, self._retention, metrics=metrics, protected=protected)
            if not _distributed.is_primary():  # the primary deletes them
                for s in doomed:
                    self._step_removed(s)
                return removed
            for s in doomed:
                with self._lock:
                    if self._reading[s] > 0:
                        continue
                    self._deleting.add(s)
                try:
                    remove_step(self._loc, s)
                    removed.append(s)
                    self._step_removed(s)
                finally:
                    with self._lock:
                        self._deleting.discard(s)
                        self._metrics.pop(s, None)
        except Exception:
            logger.exception("retention failed in %s", self._loc)
        return removed

    def _remove_unfinished(self) -> None:
        """Primary, at open and in ``gc``: removes what dead saves of ours left (proven
        ours: see ``_ownership``); everything else is left alone."""
        listing = _steps.list_directory(self._loc)
        for name in listing.unfinished:
            if not self._roll_forward(name, listing):
                _ownership.remove_if_ours(self._loc.child(name), what="unfinished step")
        foreign = list(listing.foreign)
        if not self._loc.is_local:  # object stores: a step written in place, never committed
            for name in listing.foreign:
                if _steps.is_step_name(name) and _ownership.remove_if_ours(
                    self._loc.child(name), what="uncommitted step"
                ):
                    foreign.remove(name)
        if foreign:
            logger.warning(
                "%s holds entries that are not steps of this library, left alone: %s",
                self._loc,
                ", ".join(foreign[:10]),
            )

    def _roll_forward(self, name: str, listing: _steps.Listing) -> bool:
        """A ``.partial-`` holding a valid manifest whose step is missing was committed
        but not yet renamed (a crash between the renames of a replacement): finish it."""
        step_name, kind = name.split(".", 1)
        if not kind.startswith("partial-") or int(step_name) in listing.committed:
            return False
        src = self._loc.child(name)
        try:
            _steps.read_manifest(src)
        except CheckpointError:
            return False
        src.rename(self._loc.child(step_name))
        _ownership.unclaim(self._loc.child(step_name))  # killed before its own unclaim
        logger.warning("finished the commit of step %s in %s (was %s)", step_name, self._loc, name)
        return True

    # ------------------------------------------------------------------ restore

    def restore(
        self,
        like: Any = None,
        *,
        step: int | None = None,
        items: str | Iterable[str] | None = None,
        data_iterator: Any = None,
        partial: bool = False,
        missing: str = "error",
        transform: Any = None,
    ) -> Any:
        """Restore a step (the latest that verifies, by default).

        * No ``items``: the items of ``like`` (a TrainState, NNX object or dict of
          items) are read and merged into a state of the same kind (static fields
          from ``like``); with ``like=None`` a dict of every item (numpy arrays,
          JSON values) is returned.
        * ``items="params"``: that one item's value; ``items=("params", "extras")``:
          a dict ``{name: value}``. ``like`` then only supplies templates.
        * ``data_iterator``: its state is set to the saved one (this process's).
        * A changed model (see ``_transform``): ``partial=True`` leaves out saved
          leaves (and items) ``like`` does not have; ``missing="keep"`` keeps
          ``like``'s own value for a leaf, or a whole item, the step lacks;
          ``transform`` maps saved leaf paths within each pytree item
          (``Dense_0/kernel``) to ``like``'s: ``{regex: replacement}`` or a callable
          ``path -> path | None``. Without them a StructureError lists every difference.

        Without ``step``, a latest step that is damaged (a checksum fails, a file is
        missing) is skipped with a warning and, by a writer, moved aside to
        ``<step>.corrupt-<nonce>`` (never deleted); the newest good step is restored.
        With ``step``, damage raises. Waits for this manager's in-flight save first.
        A step being read is never deleted by this manager's retention.
        """
        changes = _transform.changes(partial=partial, missing=missing, transform=transform)
        self._check_open()
        self._wait_inflight()
        fn = lambda s: self._restore_step(s, like, items, data_iterator, changes)
        if step is not None:
            if self._tier is not None:
                self._tier.ensure_local(step)
                self._forget_steps()  # it may have copied the step here
            return self._with_step(step, fn)
        skipped: list[tuple[int, CorruptCheckpointError]] = []
        for candidate in reversed(self._restore_candidates()):
            for _ in range(2 if self._tier is not None else 1):  # local, then persistent
                try:
                    if self._tier is not None:
                        if not self._tier.ensure_local(candidate):
                            break
                        self._forget_steps()  # it may have copied the step here
                    return self._with_step(candidate, fn)
                except CorruptCheckpointError as e:
                    skipped.append((candidate, e))
                    if self._tier is not None and not self._loc.child(str(candidate)).is_dir():
                        break  # the copy down from the persistent tier failed its checks
                    self._set_aside(candidate, e)
        if skipped:
            error = skipped[0][1]  # the latest step's own error, naming its file
            error.add_note(
                f"no step of {self._loc} restores; skipped: "
                + "; ".join(f"step {s}: {e}" for s, e in skipped)
            )
            raise error
        raise CheckpointNotFoundError(f"no committed steps in {self._loc}")

    def _restore_candidates(self) -> list[int]:
        """Committed steps of both tiers, ascending (a step in both is read locally)."""
        steps = self.steps()
        if self._tier is not None:  # None: the store cannot be listed (logged)
            steps = sorted(set(steps) | set(self._tier.agreed_steps() or ()))
        return steps

    def _set_aside(self, step: int, error: Exception) -> None:
        """Moves a step whose verified read proved damage (a checksum, size or format
        mismatch) aside. A link or special file planted in it is no damage of the step's
        own data: it is skipped, never moved. Environmental errors never get here."""
        logger.warning("checkpoint: skipping damaged step %d of %s: %s", step, self._loc, error)
        if isinstance(error, ForeignEntryError):
            return
        if self._read_only or not _distributed.is_primary() or not self._loc.supports_rename:
            return
        name = f"{step}.corrupt-{secrets.token_hex(6)}"
        try:
            _steps.step_location(self._loc, step).rename(self._loc.child(name))
            self._step_removed(step)
            logger.warning("checkpoint: moved step %d aside to %s/%s", step, self._loc, name)
        except OSError as e:
            logger.warning("checkpoint: could not move step %d aside: %s", step, e)

    def _with_step(self, step: int, fn: Callable[[int], Any]) -> Any:
        step = _steps.choose_step(self._loc, self.steps(), step)
        with self._lock:
            if step in self._deleting:
                raise CheckpointNotFoundError(f"step {step} of {self._loc} is being deleted")
            self._reading[step] += 1
        try:
            result = fn(step)
            self.restored_step = step
            return result
        except (CheckpointNotFoundError, CorruptCheckpointError) as e:
            raise self._deleted_step_error(step, e) from e
        finally:
            with self._lock:
                self._reading[step] -= 1

    def _deleted_step_error(self, step: int, error: Exception) -> Exception:
        """``error``, or a StepDeletedError when ``step`` is no longer listed (another
        process's retention deleted it while this one read it)."""
        try:  # listed afresh: another process may have deleted it
            if isinstance(error, StepDeletedError) or step in _steps.committed_steps(self._loc):
                return error
        except CheckpointError:
            return error
        return StepDeletedError(
            f"step {step} of {self._loc} was deleted while it was being read (a writer's "
            f"retention policy removes old steps; restore a newer step, or keep more): {error}"
        )

    def _restore_step(
        self, step: int, like: Any, items: Any, data_iterator: Any, changes: Any = None
    ) -> Any:
        changes = changes or _transform.Changes()
        step_loc = _steps.step_location(self._loc, step)
        saved = _steps.read_manifest(step_loc).items
        like_items = split_state(like) if like is not None else {}
        single = isinstance(items, str)
        names = self._names_to_restore(step, saved, items, like, like_items, changes)
        if data_iterator is not None and "data_iterator" not in saved:
            raise UnknownItemError(
                f"step {step} of {self._loc} holds no data_iterator state; items: {sorted(saved)}"
            )
        restored = {}
        for name in names:
            restored[name] = self._restore_item(
                step, step_loc, saved[name], name, like_items.get(name), changes
            )
        if data_iterator is not None:
            self._restore_item(
                step, step_loc, saved["data_iterator"], "data_iterator", data_iterator
            )
        if items is not None:
            return restored[names[0]] if single else restored
        merged = merge_state(like, restored)
        if data_iterator is None and "data_iterator" in saved:
            self._warn_replay(step)
        return merged

    def _warn_replay(self, step: int) -> None:
        """Once per manager: a resume that leaves the saved data position out replays
        the data from wherever the new iterator starts."""
        if self._warned_replay:
            return
        self._warned_replay = True
        warnings.warn(
            f"step {step} of {self._loc} holds a 'data_iterator' item (the data position) "
            f"but no data_iterator was given, so it is not restored and the run reads its "
            f"data again from wherever the new iterator starts. Pass data_iterator=it "
            f"(CheckpointManager.restore, CheckpointCallback.on_train_start); to start the "
            f"data afresh on purpose, name the items to restore (restore(items=[...])) or "
            f"on_train_start(state, reset=('data_iterator',))",
            UserWarning,
            stacklevel=_caller_stacklevel(),
        )

    def _names_to_restore(self, step, saved, items, like, like_items, changes) -> list[str]:
        if items is not None:
            names = [items] if isinstance(items, str) else list(items)
            for n in names:
                if n not in saved:
                    raise UnknownItemError(
                        f"step {step} of {self._loc} has no item {n!r}; items: {sorted(saved)}"
                    )
            return names
        if like is not None:
            names = list(like_items)
            if changes.keep_missing:  # an item the step lacks keeps like's value
                for n in names:
                    if n not in saved:
                        _transform.check_item_keepable(n, like_items[n])
                names = [n for n in names if n in saved]
            absent = [n for n in names if n not in saved]
            if absent:
                shown = ", ".join(repr(n) for n in absent)
                raise StructureError(
                    f"like has item{'s' if len(absent) > 1 else ''} {shown} but step {step} "
                    f"of {self._loc} does not; saved items: {sorted(saved)}. To keep like's "
                    f"value for {'them' if len(absent) > 1 else 'it'} (a part added to the "
                    f"model), pass missing='keep'"
                )
            return names
        return [n for n in saved if n != "data_iterator"]

    def _restore_item(
        self,
        step: int,
        step_loc: Location,
        entry: ItemEntry,
        name: str,
        like: Any,
        changes: Any = None,
    ) -> Any:
        try:
            handler = checkpointable_for(name, self._overrides)
            if isinstance(handler, PytreeCheckpointable) and changes is not None:
                return handler.restore(step_loc.child(entry.dir), like, **changes.kwargs())
            return handler.restore(step_loc.child(entry.dir), like)
        except StructureError as e:
            raise item_mismatch(e, name=name, step=step, location=self._loc) from e
        except CheckpointError as e:
            e.add_note(f"while restoring item {name!r} of step {step} from {self._loc}")
            raise

    # ------------------------------------------------------------------ lifecycle

    @property
    def save_in_flight(self) -> bool:
        """True while a save's background phase runs (not yet committed or failed)."""
        handle = self._inflight
        return handle is not None and not handle.done()

    @property
    def last_save(self) -> SaveResult | None:
        """Figures of the most recently committed save of this manager, if any."""
        with self._lock:
            return self._last_save

    def wait(self) -> None:
        """Block until the in-flight save is committed and retention has run.

        With several processes every process must call it (in the same order as save).
        Re-raises a background save error (once).
        """
        self._wait_inflight()
        fut = self._retention_future
        if fut is not None:
            fut.result()
        # Retention runs on the primary only: meet so that every process lists the same
        # steps afterwards (wait is collective, like save, with several processes).
        _distributed.barrier(_distributed.next_operation_id("manager-wait"))

    def close(self) -> None:
        """Wait for the in-flight save, stop the threads, release the lock. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
            if self._tier is not None:  # after SIGTERM: within the grace period
                grace = self._tier.grace_seconds if self.preempted else None
                self._tier.close(grace, raise_errors=not self.preempted)
        finally:
            if self._tier is not None:
                self._tier.close(0, raise_errors=False)
            self._closed = True
            if self._buffers is not None:
                self._buffers.clear()
            if self._delete_pool is not None:
                self._delete_pool.shutdown(wait=True)
            if self._preemption is not None:
                self._preemption.uninstall()
            self._release_lock()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:
            logger.exception("error while closing the checkpoint manager")

    def __del__(self):
        try:
            if not self._closed:
                self._release_lock()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ internals

    def _release_lock(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"manager on {self._loc} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._read_only:
            raise CheckpointError(f"manager on {self._loc} is read-only")

    def _raise_background_error(self) -> None:
        handle = self._inflight
        if handle is not None and handle.done():
            self._wait_inflight()

    def _wait_inflight(self) -> None:
        handle, self._inflight = self._inflight, None
        if handle is not None:
            handle.wait()


remove_step = _ownership.remove_step  # deletes a committed step of ours (see there)


def _wait_all(pendings: Iterable[Pending], *, raise_first: bool = False) -> list[Any]:
    """Waits for every pending write (even after one failed: none stays in flight)."""
    results, first = [], None
    for p in pendings:
        try:
            results.append(p.wait())
        except BaseException as e:  # noqa: BLE001
            results.append(None)
            first = first or e
    if raise_first and first is not None:
        raise first
    return results


def _as_metric(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


_MANAGER_OPTIONS = _manager_option_names()
