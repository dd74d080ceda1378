"""CheckpointManager: a directory of training steps (the façade).

One training thread owns a manager (``save`` / ``restore`` / ``wait`` / ``close``); a
save's writes and commit run on a background thread, retention on a deletion thread;
a background error is re-raised by the next call. With several processes every
process makes the same calls in the same order. The work is done by collaborators
given what they need (``options``, ``book``, ``schedule``, ``saving``, ``step_commit``,
``restoring``, ``retaining``, ``housekeeping``): docs/manager.md, with the layout and
the threading in full.
"""

from __future__ import annotations

import logging
import operator
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._base import distributed as _distributed
from .._base import host as _host
from .._core import ownership as _ownership
from .._core.save import SaveResult
from .._errors import CheckpointError
from .._like import transform as _transform
from .._storage import shared_dir as _shared_dir
from .._storage.lock import DirectoryLock
from . import housekeeping as _housekeeping
from . import options as _options
from . import per_host as _per_host
from .book import StepBook
from .checkpointables import Checkpointable
from .preemption import Preemption
from .restoring import Restorer
from .retaining import RetentionRunner
from .saving import Saver, collect_items
from .schedule import SaveSchedule
from .tiers import PersistentTier

__all__ = ["CheckpointManager", "MANAGER_DEFAULTS", "MANAGER_OPTIONS"]

logger = logging.getLogger("flax_orbax_plugin")


class CheckpointManager:
    """A directory of training steps: save policy, retention, async saves, restore.

    Args (keyword-only after ``directory``; each checked when the manager is made, and
    one that does nothing in the chosen mode refused: OptionError naming it):
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
        Call ``save`` (or ``should_save``) at every step, on every process (several
        processes: docs/manager.md, "Options in depth").
      checkpointables: overrides of the checkpointable used per item name.
      incremental: a pytree leaf unchanged since the previous committed step is
        hard-linked from it (local disk) or copied on the server (S3, GCS), not
        written (what "unchanged" means: docs/manager.md). See _incremental.
      compression: per pytree item, ``"zstd"`` or ``"zstd:<level>"``, e.g.
        ``{"opt_state": "zstd"}``; restore reads the codec from the checkpoint.
      format_version: 1, or 2 (data files per process: FORMAT.md, "Version 2").
      clock: time source for ``every_seconds`` (tests pass one in).
      persistent: a second, persistent tier (``s3://``, ``gs://``, a shared
        filesystem path) to which every step committed in ``directory`` (then a
        local disk, shared or each host's own) is replicated in the background, with
        its own commit; restore takes the newest good step of either tier (docs/tiers.md).
      persistent_keep, persistent_keep_every: the persistent tier's retention (as
        ``keep`` and ``keep_every``; ``persistent_keep=None`` keeps every step there).
      persistent_every: only committed steps divisible by it (as ``keep_every``) and
        the step saved on SIGTERM are replicated (1: every step); local retention keeps
        those until replicated, the others it deletes as usual. See docs/tiers.md.
      persistent_grace_seconds: after SIGTERM, how long the exit waits for its step.
      persistent_lease_seconds: one run owns its places: a second live manager on the
        persistent path is refused (a lock on filesystems; on object stores a lease of
        this many seconds, renewed every third of it). See ``_run_owner``.
      reuse_host_buffers: (default) copy the state into host buffers kept from the
        previous save until ``close``; off: hold CPU arrays as views (docs/manager.md).
      host_memory_budget: host bytes a version 1 step (not incremental) may hold
        beyond the state (None: no bound; set, nothing is pooled). ``fop.save_async``.
      on_event: receives each checkpoint event record (docs/manager.md, "Events").

    ``wait()``: the local tier, ``persistent.wait()``: the replication, ``close()``:
    both. A writer locks a local directory (a second live writer: DirectoryLockedError)
    and removes unfinished temporary steps; a step or core checkpoint is refused.
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
        persistent_every: int = 1,
        persistent_grace_seconds: float = 30.0,
        persistent_lease_seconds: float = 60.0,
        reuse_host_buffers: bool = True,
        format_version: int = 1,
        host_memory_budget: int | None = None,
        on_event: Callable[[Any], Any] | None = None,
        **unknown: Any,
    ):
        with _distributed.collective("manager-open", spans=not read_only):  # _base.regions
            _options.check_unknown("CheckpointManager", unknown, MANAGER_OPTIONS)
            opts = _options.ManagerOptions.build(directory, locals(), MANAGER_DEFAULTS)
            self._loc = opts.location
            self._schedule = SaveSchedule(opts.save_policy(), opts.clock)
            self._async, self._read_only = opts.async_save, opts.read_only
            pooled = opts.reuse_host_buffers and opts.host_memory_budget is None
            self._buffers = _host.BufferPool() if pooled else None
            self._book = StepBook(self._loc, on_event=opts.on_event)
            self._retainer = RetentionRunner(self._loc, opts.retention, opts.overrides, self._book)
            self._saver = Saver(
                self._loc, opts.overrides, self._book, self._retainer, opts.incremental,
                self._buffers, opts.host_memory_budget, opts.format_version,
            )  # fmt: skip
            self._restorer = Restorer(self._loc, opts.overrides, self._book, opts.read_only)
            self._closed = False
            self._dir_lock: DirectoryLock | None = None
            _housekeeping.refuse_step_directory(self._loc)
            opts.check_reader()
            if not opts.read_only:
                self._open(opts)

    def _open(self, opts: _options.ManagerOptions) -> None:
        """A writer's open: lock, housekeeping, deletion thread, tier, SIGTERM."""
        own = _per_host.detect(self._loc, opts.persistent, opts.incremental, opts.format_version)
        self._book.per_host = own  # each host's own directory (docs/tiers.md)
        self._dir_lock = _housekeeping.open_writer(self._loc, own=own)
        self._retainer.start(busy=lambda: self._saver.busy)  # a save runs: fewer deletes
        try:  # several processes on a local path: the same directory on every host
            if opts.persistent is None:
                _shared_dir.check_visible(self._loc)
            else:
                self._book.tier = PersistentTier(
                    self._loc,
                    opts.persistent,
                    remove_step=_ownership.remove_step,
                    busy=lambda: self.save_in_flight,
                    per_host=own,
                    **opts.tier_options(),
                )
                _per_host.open_tier(self._book, self.steps())
            if opts.handle_sigterm:
                self._schedule.preemption = Preemption.install()
        except BaseException:  # the others learn of it at once: waits for none of them
            self._shut()
            raise

    directory = property(lambda self: str(self._loc), doc="The directory, as a string.")

    def steps(self) -> list[int]:
        """Committed steps, ascending (steps being deleted are left out), as listed in
        the store now. A save never calls it: it uses the steps known in memory."""
        return self._book.listed()

    def _forget_steps(self) -> None:  # removed behind its back: the next need lists them
        self._book.forget()

    def latest_step(self, *, include_persistent: bool = False) -> int | None:
        """The highest committed step, or None when there is none; with
        ``include_persistent``, of either tier (what ``restore()`` starts from)."""
        return self._book.latest(include_persistent=include_persistent)

    @property
    def persistent(self) -> PersistentTier | None:
        """The persistent tier (``persistent=``), or None."""
        return self._book.tier

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``handle_sigterm=True``); with several
        processes, once the step every process saves before stopping was reached."""
        return self._schedule.preempted

    _preemption = property(lambda self: self._schedule.preemption)

    def _preempted_at(self, step: int) -> bool:  # to be saved before stopping?
        return self._schedule.preempted_at(step)

    commit_log_level = property(
        lambda self: self._saver.log_level,
        lambda self, level: setattr(self._saver, "log_level", level),
        doc="The level of the line logged per commit (a callback with a writer: DEBUG).",
    )

    def should_save(self, step: int, *, t: float | None = None) -> bool:
        """Whether the policy asks for ``step`` (this process's view; ``save`` shares the
        primary's time-based decision with every process)."""
        return self._schedule.should_save(operator.index(step), t)

    @_distributed.collective("manager-save")
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
        step = _options.check_save_call(step=step, force=force, overwrite=overwrite, t=t)
        preempted = self._preempted_at(step)  # first: asked at every step, in order
        self._saver.raise_background_error()
        if not (force or preempted or self._schedule.decide(step, t)):
            return False
        self._wait_inflight()
        with self._saver.saving():  # from here to its commit, removals yield to the save
            local = self._saver.check_new_step(step, overwrite or preempted)
            extras = extras() if callable(extras) else extras  # only for a step that is saved
            items = collect_items(state, data_iterator, extras)
            self._saver.start(step, items, extras, local, replicate=preempted)
        self._schedule.record_save(t)
        if not self._async or preempted:
            self._wait_inflight()
        if preempted:
            self._book.events.holding(self.close)  # a hook's error (logged) never stops it
            raise SystemExit(128 + signal.SIGTERM)
        self._book.events.raise_after_save()  # a hook's, once this step is saved too
        return True

    def gc(self) -> list[int]:
        """Removes unfinished steps and applies retention now; returns the removed steps.
        Call from the training thread (waits for the in-flight save first)."""
        self._check_writable()
        self.wait()
        self._book.forget()  # gc looks at the store itself
        if _distributed.is_primary() or self._book.per_host:
            _housekeeping.remove_unfinished(self._loc)
        return self._retainer.run_now()

    @_distributed.collective("manager-restore")
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
        return self._restorer.restore(like, step, items, data_iterator, changes)

    @property
    def restored_step(self) -> int | None:
        """The step the last ``restore()`` read (None before one succeeded)."""
        return self._restorer.restored_step

    @property
    def save_in_flight(self) -> bool:
        """True while a save's background phase runs (not yet committed or failed)."""
        return self._saver.in_flight

    @property
    def last_save(self) -> SaveResult | None:
        """Figures of the most recently committed save of this manager, if any."""
        return self._book.last_save

    @_distributed.collective("manager-wait")
    def wait(self) -> None:
        """Block until the in-flight save is committed and retention has run.

        With several processes every process must call it (in the same order as save).
        Re-raises a background save error (once), then an ``on_event`` hook's.
        """
        self._wait_inflight()
        self._retainer.wait()
        # Retention runs on the primary only: meet so that every process lists the same steps
        # (and learns of an on_event hook's error on any of them: events.agree).
        self._book.events.agree("manager-wait", what=f"wait of {self._loc}")

    def close(self) -> None:
        """Wait for the in-flight save, stop the threads, release the lock. Idempotent."""
        if self._closed:
            return
        try:
            self._book.events.holding(self.wait)  # a hook's error: raised once closed
            tier = self._book.tier
            if tier is not None:  # after SIGTERM: within the grace period
                grace = tier.grace_seconds if self.preempted else None
                tier.close(grace, raise_errors=not self.preempted)
        finally:
            self._shut()
        self._book.events.raise_error()

    def _shut(self) -> None:
        """Stops the threads and releases the lock (waits for no other process)."""
        self._book.tier is not None and self._book.tier.close(0, raise_errors=False)
        self._closed = True
        self._buffers is not None and self._buffers.clear()
        self._retainer.shutdown()
        self._schedule.uninstall()
        self._release_lock()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:  # else the with block's own error goes on, this one logged
                raise
            logger.exception("error while closing the checkpoint manager")

    def __del__(self):
        try:
            self._closed or self._release_lock()
        except Exception:  # noqa: BLE001
            pass

    def _release_lock(self) -> None:
        self._dir_lock is not None and self._dir_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"manager on {self._loc} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._read_only:
            raise CheckpointError(f"manager on {self._loc} is read-only")

    _inflight = property(lambda self: self._saver.inflight)  # the callback matches it

    def _wait_inflight(self) -> None:
        self._saver.wait()


MANAGER_DEFAULTS = _options.keyword_defaults(CheckpointManager.__init__)
MANAGER_OPTIONS = tuple(MANAGER_DEFAULTS)
