"""CheckpointManager: a directory of training steps (the façade), and how it ends.

One training thread owns a manager; a save's writes and commit run on a background
thread, retention on a deletion thread; a background error is re-raised by the next
call. With several processes every process makes the same calls in the same order.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.manager``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import signal
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from .._base import distributed as _distributed
from .._base import failures as _failures
from .._base import host as _host
from .._base.env import Option, check, flag, found
from .._base.host_memory import BufferPool
from .._core import removing as _removing
from .._core.formats import MEMORY_LIMIT
from .._core.save import SaveHandle, SaveResult
from .._errors import CheckpointError, OptionError, OptionTypeError
from .._format.foreign import refuse_foreign_run
from .._format.steps import checked_step
from .._like import onto_like as _onto_like
from .._storage import shared_dir as _shared_dir
from .._storage.store_errors import refusals
from . import checkpointables as _checkpointables
from . import housekeeping as _housekeeping
from . import options as _options
from . import per_host as _per_host
from .events import Events, HookGuarded
from .options import MANAGER, SAVE_CALL
from .restoring import Restorer
from .retaining import RetentionRunner, StepBook
from .save_rules import SaveSchedule
from .saving import Saver, collect_items
from .step_parts import StepParts, checked_expect
from .tiers import PersistentTier
from .zero_copy import ZeroCopyStep

logger = logging.getLogger("flax_orbax_plugin")

# Writers not closed yet: they end when the program ends.
_OPEN: weakref.WeakSet = weakref.WeakSet()


def _leave_all() -> bool:
    """The exit hook (``_base.host``) for the writers not closed: one process closes each
    (or shuts it after an uncaught error); several: each leaves the run."""
    error = getattr(sys, "last_value", None)  # set by now for an uncaught exception
    alone = _distributed.process_count() == 1
    failed = False
    for manager in list(_OPEN):
        try:
            if alone and error is None:
                tier = manager._book.tier
                left = [] if tier is None else sorted(tier.pending_steps())
                if left:  # the program does not end at once: said, as for a save running
                    where = f"the persistent tier {tier.remote}"  # type: ignore[union-attr]
                    said = f"the program ends: copying steps {left} to {where}"
                    print(f"flax_orbax_plugin: {said}", file=sys.stderr)
                manager.close()
            elif alone and not manager._closed:  # saves finished or cancelled (exits.FINISH)
                manager._shut()
            else:
                closed = "the program ended without closing its CheckpointManager"
                manager.leave(error or CheckpointError(closed))
        except Exception as e:  # noqa: BLE001  (the program is ending: said, then the next)
            said = f"closing {manager._loc} at exit failed: {type(e).__name__}: {e}"
            print(f"flax_orbax_plugin: {said}", file=sys.stderr)
            failed = failed or (alone and error is None)  # nobody else reads it: status 1
    return failed


def _places(bound: dict[str, Any]) -> list[Any]:
    """The stores a manager's call may reach: its directory and its persistent tier."""
    tier = (bound.get("options") or {}).get("persistent")
    own = getattr(bound["self"], "directory", None)
    return [bound.get("directory"), getattr(tier, "path", tier), own]


# A store's refusal, in any call of a manager: StoreAccessError naming the store.
_STORE_ERRORS = refusals(_places)
# The entry of a collective method: its region's stall timeout and scope are the manager's.
_collective = functools.partial(
    _distributed.public, errors=_STORE_ERRORS, stall="_stall_s", scope="_scope"
)


@_distributed.public(errors=_STORE_ERRORS)  # every other public method's entry
class CheckpointManager(HookGuarded):
    # __init__'s docstring and signature: from options.MANAGER (options.document)

    def __init__(self, directory: Any, **options: Any):
        spans, stall_s = not options.get("read_only"), _options.open_stall(options)
        with _distributed.collective("manager-open", spans=spans, stall_s=stall_s) as region:
            opts = _options.ManagerOptions.build(directory, options)
            self._loc, self._stall_s = opts.location, opts.stall_timeout
            self._unheld = set(opts.overrides) - {getattr(opts.hf_shards, "name", None)}
            self._scope = region.tag  # its operations' (lifecycle)
            self._schedule = SaveSchedule(
                opts.policy,
                opts.clock,
                opts.retention.uses_time,
                context=lambda: (bool(self._book.known()), self._saver.in_flight),
            )
            self._async, self._read_only = opts.async_save, opts.read_only
            self._supersede = opts.supersede  # False, "preemption" or True
            self._replaced = False  # the save in flight replaced a cancelled one
            self._buffers = BufferPool() if opts.reuse_host_buffers else None  # asked for
            _housekeeping.refuse_step_directory(self._loc)
            opts.check_reader()
            refuse_foreign_run(self._loc, writing=not opts.read_only)  # before anything
            events = Events(opts.on_event)  # where every collaborator's events go
            opened = {} if opts.read_only else self._open(opts, events, region)
            self._book = StepBook(self._loc, events, **opened)  # built whole, once opened
            # busy(): which part of a save runs, asked by removals (the saver is built next)
            self._retainer = RetentionRunner(opts, self._book, lambda: self._saver.busy)
            self._saver = Saver(opts, self._book, self._retainer, self._buffers)
            self._restorer = Restorer(opts, self._book)
            self._closed = False
            self._parts: StepParts | None = None  # a step being saved in parts (step_parts)
            if not opts.read_only:
                self._start(opts)

    def _open(self, opts: _options.ManagerOptions, events: Events, region) -> dict[str, Any]:
        """A writer's open, in ``region``; returns what the book is built with."""
        _housekeeping.check_same_options(opts, region)  # before anything is touched
        tier, path = opts.tier, None if opts.tier is None else opts.tier.path
        own = _per_host.detect(self._loc, path, opts.incremental, opts.format_version, region)
        writer = _housekeeping.open_writer(self._loc, own=own, region=region)
        opened: dict[str, Any] = {"per_host": own, "writer": writer}  # own: docs/tiers.md
        try:  # several processes on a local path: the same directory on every host
            if tier is None:
                _shared_dir.check_visible(self._loc, region)
                return opened
            opened["tier"] = tier.open(
                self._loc,
                remove_step=_removing.remove_step,
                busy=lambda: "_saver" in vars(self) and self.save_in_flight,
                per_host=own,
                host_memory=opts.host_memory,  # bounds the tier's copies too
                events=events,  # told of each replicated step and removal
            )
            opened["run"] = _per_host.open_tier(self._loc, opened["tier"], own, region)
            return opened
        except BaseException:  # the others learn of it at once: waits for none of them
            if "tier" in opened:
                opened["tier"].close(0, raise_errors=False)
            if writer is not None:  # no lock file left where there was none
                writer.discard()
                writer.release()
            raise

    def _start(self, opts: _options.ManagerOptions) -> None:
        """A writer's open, once built: deletion thread, SIGTERM, the policy's clock, exit hook."""
        try:
            self._retainer.start()
            self._schedule.watch(handle_sigterm=opts.handle_sigterm)  # or OnPreemption()
            self._schedule.resume_clock(lambda: _housekeeping.saved_at(self._loc, self.steps()))
            _OPEN.add(self)  # a program ending without close(): _leave_all
            _host.at_exit(_host.LEAVE, _leave_all)
        except BaseException:  # the others learn of it at once: waits for none of them
            self._shut(refused=True)  # no lock file left where there was none
            raise

    @property
    def directory(self) -> str:
        """The directory, as a string."""
        return str(self._loc)

    def steps(self) -> list[int]:
        """Committed steps, ascending (steps being deleted left out), as listed in the
        store now (``all_steps()``, Orbax's name, too). A save uses those in memory."""
        return self._book.listed()

    all_steps = steps

    @_collective("manager-delete")
    def delete(self, *steps: int, region: _distributed.Region) -> None:
        """Removes the committed ``steps`` of this directory now, through the one owner
        of removal (only steps this library committed; each leaves listings at once);
        a step that is not committed is a CheckpointNotFoundError and removes nothing.
        The persistent tier's copies stay (``persistent.remove(step)``). Call from the
        training thread; waits for the save in flight first. With several processes
        every process calls it with the same steps (a collective): all meet, the primary
        removes the steps (each host its own, agreed first: ``per_host.remove_steps``)."""
        self._check_writable()
        self._saver.wait()
        steps = list(dict.fromkeys(checked_step(step) for step in steps))  # each once
        region.barrier(region.next_operation_id("manager-delete"))
        if self._book.per_host:  # each host its own, agreed first
            _per_host.remove_steps(self._loc, steps, self.steps(), region)
        elif _distributed.is_primary():
            _housekeeping.remove_committed(self._loc, steps, self.steps())
        self._book.forget()  # the next need lists the store
        region.barrier(region.next_operation_id("manager-delete"))

    def latest_step(self, *, include_persistent: bool = True) -> int | None:
        """The highest committed step of either tier (``restore()``'s first), or None;
        ``include_persistent=False``: of this directory alone."""
        return self._book.latest(include_persistent=flag("include_persistent", include_persistent))

    @property
    def persistent(self) -> PersistentTier | None:
        """The persistent tier (``persistent=``), or None."""
        return self._book.tier

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``handle_sigterm=True``); with several
        processes, once the step every process saves before stopping was reached."""
        return self._schedule.preempted

    def preempted_at(self, step: int) -> bool:
        """Whether ``step`` is the step to save before stopping (``handle_sigterm=True``
        and SIGTERM arrived; with several processes, the step all of them agreed on).
        ``save`` asks it itself; a caller that skips ``save`` for a step (already
        saved) asks it instead: once per step, in order, on every process."""
        return self._schedule.preempted_at(checked_step(step))

    @property
    def commit_log_level(self) -> int:
        """The level of the line logged per commit (DEBUG for a callback with a writer)."""
        return self._saver.log_level

    @commit_log_level.setter
    def commit_log_level(self, level: int) -> None:
        self._saver.log_level = Option("commit_log_level", "int", low=0).check(level)

    def should_save(self, step: int, *, t: float | None = None) -> bool:
        """Whether the policy asks for ``step`` (this process's view; ``save`` shares the
        primary's time-based decision with every process)."""
        return self._schedule.should_save(checked_step(step), t)

    @_collective("manager-save")
    def save(
        self,
        step: int,
        state: Any = None,
        *,
        region: _distributed.Region,
        data_iterator: Any = None,
        extras: Mapping[str, Any] | None = None,
        ignore_policy: bool = False,
        overwrite: bool = False,
        t: float | None = None,
        force: bool | None = None,
    ) -> bool:
        """Save ``state`` as ``step`` if the policy says so; return whether it saved.

        ``state`` is split into checkpointables (``_state/train_state.py``): a Flax
        TrainState, NNX module/optimizer, or a dict of items. ``data_iterator``'s
        state and the JSON ``extras`` become items too. ``ignore_policy=True`` saves
        whatever the policy says (``force=``, its old name, warns). A step at or below
        the latest committed one is refused unless ``overwrite=True`` (which replaces an
        existing step atomically). ``t`` is the time of the decision (default: the
        manager's clock). ``extras`` may be a callable returning the mapping, called only
        when the step is saved.

        Returns once every item's blocking phase is done (state may then be mutated
        or donated); the write completes in the background unless ``async_save=False``.
        A save still writing is waited for first, or cancelled (``supersede=``: see
        ``Saver.supersede``). Call from the training thread only; with several
        processes, on every process.
        """
        self._check_writable()
        self._refuse_open_parts("save")
        step, ignore_policy = _check_save_call(
            step=step, ignore_policy=ignore_policy, force=force, overwrite=overwrite, t=t
        )
        schedule, preempted = self._schedule, self._schedule.preempted_at(step)  # every step
        stop = preempted and schedule.stops  # handle_sigterm: save, close and exit
        supersede = self._supersede is True or (preempted and self._supersede == "preemption")
        if not supersede:  # superseding: a cancelled save's error is expected (below)
            with _not_saved(step):
                self._saver.raise_background_error()
        lane, now = schedule.decide(step, t, forced=ignore_policy or stop, region=region)
        if lane is None:
            return False
        self._end_inflight(step, supersede=supersede, preempted=preempted)
        began = schedule.clock()  # the blocking time, as Continuous() measures it
        with self._saver.saving():  # from here to its commit, removals yield to the save
            local = self._saver.check_new_step(step, overwrite or stop, region)
            items, extras = self._items(state, data_iterator, extras)
            self._book.note_save(step, now, lane)  # its time and lane (KeepFor, Lanes)
            replicate = stop or schedule.preemption_step == step  # to the tier anyway
            self._saver.start(step, items, extras, local, replicate=replicate, region=region)
        schedule.record_save(now, schedule.clock() - began)
        if not self._async or stop:
            self._saver.wait()
        if stop:  # closes in this save's region; a hook's error (logged) never stops it
            self._book.events.holding(lambda: self._close(functools.partial(self._meet, region)))
            raise SystemExit(128 + signal.SIGTERM)
        self._book.events.raise_after_save(step)  # a hook's, once this step is saved too
        return True

    def _end_inflight(self, step: int, *, supersede: bool, preempted: bool) -> None:
        """Waits for the save in flight, or cancels it (not twice in a row: ``supersede=``)."""
        if supersede and (preempted or not self._replaced):
            self._replaced = self._saver.supersede(step)
        else:
            with _not_saved(step):
                self._saver.wait()
            self._replaced = False

    def _items(self, state: Any, data_iterator: Any, extras: Any) -> tuple[dict, Any]:
        extras = extras() if callable(extras) else extras  # only for a step that is saved
        if extras is not None and not isinstance(extras, Mapping):
            what = "extras (or what extras_fn returned)"
            raise OptionTypeError(f"{what}: expected a dict of JSON values, found {found(extras)}")
        items = collect_items(state, data_iterator, extras)
        if self._unheld:  # the first save: a name that matched no item warns, once
            self._unheld = _checkpointables.warn_unheld(self._unheld, items)
        return items, extras

    @_collective("manager-save-parts")
    def step_parts(
        self,
        step: int,
        *,
        region: _distributed.Region,
        expect: Iterable[str],
        overwrite: bool = False,
    ) -> StepParts:
        """Opens ``step`` to be saved in parts, from several calls: returns a
        :class:`StepParts` (a context manager) whose ``save(name, value)`` adds item
        ``name``; the step commits once, when the last of ``expect`` (item names) is
        saved, with the one-commit rule of ``save``. Until then it is never listed,
        restored or counted; leaving the ``with`` block (or ``abort()``) with parts
        missing removes what it staged. The policy is not asked (see ``should_save``);
        ``overwrite`` as in ``save``. One step at a time: ``save``, ``gc`` and another
        ``step_parts`` are refused while one is open. Waits for the save in flight
        first. Training thread; with several processes every process opens the step
        and saves every part, in the same order (docs/manager.md)."""
        self._check_writable()
        self._refuse_open_parts("step_parts")
        step, names = checked_step(step), checked_expect(expect)
        overwrite = flag("overwrite", overwrite)
        if self._book.per_host:
            raise CheckpointError(
                f"step_parts: {self._loc} is each host's own directory; a step in parts needs "
                "a directory every host shares: save the step whole with manager.save"
            )
        with _not_saved(step):
            self._saver.wait()
        schedule = self._schedule
        lane, now = schedule.decide(step, None, forced=True, region=region)
        with self._saver.saving():
            local = self._saver.check_new_step(step, overwrite, region)
            copies = self._saver.copies(step, names)
            self._book.note_save(step, now, lane)
            opened = self._saver.begin_parts(step, local, region)

        def finished(blocking: float) -> None:
            schedule.record_save(now, blocking)
            if not self._async:
                self._saver.wait()

        self._parts = StepParts(
            self._saver,
            opened,
            names,
            region,
            where=str(self._loc),
            copies=copies,
            finished=finished,
        )
        return self._parts

    def _refuse_open_parts(self, call: str) -> None:
        parts = self._parts
        if parts is not None and parts.open:
            raise CheckpointError(
                f"{call}: step {parts.step} of {self._loc} is being saved in parts "
                f"(missing: {list(parts.missing)}); save its last part or abort() it first"
            )

    def _drop_parts(self) -> None:
        parts, self._parts = self._parts, None
        if parts is not None and parts.open:
            logger.warning(
                "checkpoint: the manager on %s closes with step %d open in parts (missing: "
                "%s); it is given up, nothing committed",
                self._loc,
                parts.step,
                list(parts.missing),
            )
            parts.abort()

    def gc(self) -> list[int]:
        """Removes unfinished steps and applies retention now; returns the removed steps.
        Call from the training thread (waits for the in-flight save first)."""
        self._check_writable()
        self._refuse_open_parts("gc")
        self.wait()
        self._book.forget()  # gc looks at the store itself
        ours = _distributed.is_primary() or self._book.per_host  # stuck: raised after retention
        stuck = _housekeeping.remove_unfinished(self._loc, warn=False) if ours else {}  # said
        removed = self._retainer.run_now()
        if stuck:
            raise CheckpointError(
                f"gc could not remove what interrupted saves or removals left in {self._loc} "
                f"(proven this library's; no step is affected): "
                + "; ".join(f"{name}: {why}" for name, why in sorted(stuck.items()))
            )
        return removed

    @_collective("manager-restore")
    def restore(
        self,
        like: Any = None,
        *,
        region: _distributed.Region,
        step: int | None = None,
        items: str | Iterable[str] | None = None,
        data_iterator: Any = None,
        partial: bool = False,
        missing: str = "error",
        transform: Any = None,
        surgery: Any = None,
        memory_limit_bytes: int | None = None,
    ) -> Any:
        """Restore a step (the latest that verifies, by default).

        * No ``items``: the items of ``like`` (a TrainState, NNX object or dict of
          items) are read and merged into a state of the same kind (static fields
          from ``like``); with ``like=None`` a dict of every item (numpy arrays,
          JSON values) is returned.
        * ``items="params"``: that one item's value; ``items=("params", "extras")``:
          a dict ``{name: value}``. ``like`` then only supplies templates.
        * ``data_iterator``: its state is set to the saved one (this process's).
        * A changed model: ``partial``, ``missing`` (also ``"keep"`` for a whole item
          the step lacks), ``transform`` and ``surgery`` as in ``fop.restore``, within
          each pytree item. Without them a StructureError lists every difference.

        Without ``step``, a latest step that is damaged (a checksum fails, a file is
        missing) is skipped with a warning and, by a writer, moved aside to
        ``<step>.corrupt-<nonce>`` (never deleted); the newest good step is restored.
        With ``step``, damage raises. Waits for the save in flight first (not from a hook).
        A step being read is never deleted by this manager's retention.

        ``memory_limit_bytes``: the host memory this restore's reads hold at most (bytes;
        never above the manager's ``host_memory``, which applies without it).
        """
        if isinstance(like, numbers.Integral) and not isinstance(like, bool):
            raise OptionTypeError(
                f"restore(like): expected a template (a TrainState, NNX object, dict of "
                f"items or None), found the int {like}; for a step: restore(step={like})"
            )
        changes = _onto_like.changes(
            partial=partial, missing=missing, transform=transform, surgery=surgery
        )
        limit = MEMORY_LIMIT.check(memory_limit_bytes)
        self._check_open()
        self._saver.wait()
        return self._restorer.restore(like, step, items, data_iterator, changes, region, limit)

    @property
    def restored_step(self) -> int | None:
        """The step the last ``restore()`` read (None before one succeeded)."""
        return self._restorer.restored_step

    @property
    def save_in_flight(self) -> bool:
        """True while a save's background phase runs (not yet committed or failed)."""
        return self._saver.in_flight

    @property
    def pending_save(self) -> SaveHandle | None:
        """The handle of the save in flight (None once it was waited for, or for a
        synchronous save, already committed when ``save`` returned)."""
        return self._saver.inflight

    def wait_for_save(self) -> None:
        """Block until this process's save in flight is committed; re-raises its
        background error (once). Unlike :meth:`wait` it is no collective operation and
        waits for no retention: a caller that polls :attr:`pending_save` calls it."""
        self._saver.wait()

    def warn_data_replay(self) -> None:
        """Warns (once) when the step last restored holds a data position that was not
        restored (the run would read its data again); a resume that restores named
        items (the callback's ``reset=``) calls it after."""
        if self.restored_step is not None:
            self._restorer.warn_replay(self.restored_step)

    @property
    def last_save(self) -> SaveResult | None:
        """Figures of the most recently committed save of this manager, if any."""
        return self._book.last_save

    @_collective("manager-wait")
    def wait(self, *, region: _distributed.Region) -> None:
        """Block until the in-flight save is committed and retention has run.

        With several processes every process must call it (in the same order as save).
        Re-raises a background save error (once), then an ``on_event`` hook's.
        """
        self._meet(region)

    def _meet(self, region: _distributed.Region) -> None:
        self._saver.wait()
        self._retainer.wait()
        # Retention runs on the primary only: every process then lists the same steps.
        self._book.events.agree("manager-wait", region, what=f"wait of {self._loc}")

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"manager on {self._loc} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._read_only:
            raise CheckpointError(f"manager on {self._loc} is read-only")
        if self._book.writer is not None and self._book.writer.take_again_if_lost():
            self._book.forget()  # its directory removed under it: what it lists is gone

    def reserve(self, like: Any) -> int:
        """Allocates and populates (``MADV_POPULATE_WRITE``) the host buffers one save of
        ``like`` (the state, or ShapeDtypeStructs on one device) copies into: the first
        save costs what a steady one does. Returns the bytes allocated (0 once
        :meth:`wrap_step` was called: saves then copy nothing). Training thread, before
        the loop (``CheckpointCallback.on_train_start`` calls it); read-only: refused."""
        self._check_writable()
        return self._saver.reserve(like)

    def wrap_step(
        self,
        fn: Callable,
        *,
        donate_argnums: int | Sequence[int] = 0,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
    ) -> ZeroCopyStep:
        """``fn`` as a jitted step that never needs a copy of what this manager saves
        (``_manager/zero_copy.py``): ``step = mngr.wrap_step(train_step,
        donate_argnums=0)``, then ``state, metrics = step(state, batch)``.

        From this call on, the manager's saves keep the state's CPU arrays as zero-copy
        views (no host buffers, nothing copied in the blocking phase), and the step
        right after a save writes its outputs into the previous save's arrays instead
        of donating the ones being written. Call on the training thread.

        Not recommended for speed: measured on CPU (1.2 GB state, a save every 10 of 60
        steps, `benchmarks/results/train_zero_copy_0.6.md`) its loop took 1.31x the run
        without saves against 1.26x with ``reuse_host_buffers=True``: its blocking phase
        is shorter (23 ms against 120 ms) but every step ran slower (0.30 s against 0.27
        s median), two states held and the spare's variant competing with the writer.
        It saves host memory between saves against the pool; on accelerators the device
        staging makes it moot."""
        self._check_writable()
        step = ZeroCopyStep(
            fn,
            donate_argnums=donate_argnums,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
        )
        self._saver.hold_views(step)
        return step

    def close(self) -> None:
        """Wait for the in-flight save, stop the threads, release the lock. Idempotent.
        With several processes, on every process (it meets them: ``wait``). Closing
        with an error (a save's, or one the others brought to the meeting), this
        process then leaves the run as :meth:`leave` does: one of the others still
        waiting for it in an operation of this manager (a step further on, after the
        processes met the error at different steps) raises at once, naming it. From
        its on_event hook: HookReentryError (``events``), and it stays open."""
        self._close(self.wait)

    def _close(self, meet: Callable[[], None]) -> None:
        if self._closed:
            return
        self._drop_parts()  # a step open in parts: given up
        try:
            self._book.events.holding(meet)  # a hook's error: raised once closed
            tier = self._book.tier
            if tier is not None:  # after SIGTERM: within the grace period
                grace = tier.grace_seconds if self.preempted else None
                tier.close(grace, raise_errors=not self.preempted)
        except BaseException as e:
            self._shut()
            _failures.announce_leaving(e, scope=self._scope, where=f"the run of {self._loc}")
            raise
        self._shut()
        self._book.events.raise_error()

    def leave(self, error: BaseException) -> None:
        """Closes after ``error`` ended this process's part of the run (what the
        ``with`` block's exit does then): the save in flight ends (committed with the
        others, or its own error logged), then the other processes are told that this
        one left: one waiting for it raises ProcessFailedError naming it and ``error``
        at once. Waits for no other process. Idempotent. From its on_event hook:
        HookReentryError, as :meth:`close`."""
        if self._closed:
            return
        try:
            self._drop_parts()  # a step open in parts: given up
            self._saver.wait()
        except BaseException:  # ``error`` goes on; this one is logged
            logger.exception("checkpoint: the save in flight failed while leaving")
        finally:
            _failures.announce_leaving(error, scope=self._scope, where=f"the run of {self._loc}")
            self._shut()

    def _shut(self, *, refused: bool = False) -> None:
        """Stops the threads, releases the lock; ``refused``: the lock file made goes too."""
        if self._book.tier is not None:
            self._book.tier.close(0, raise_errors=False)
        self._closed = True
        if self._buffers is not None:
            self._buffers.clear()
        self._retainer.shutdown()
        self._schedule.uninstall()
        if refused and self._book.writer is not None:
            self._book.writer.discard()
        self._release_lock()

    def __enter__(self):
        self._check_open()  # a closed manager: said here
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.leave(exc)

    def __del__(self):
        # No module global here: at interpreter exit they may be None already.
        try:
            if not getattr(self, "_closed", True):
                self._release_lock()
        except Exception:  # noqa: BLE001  (shutting down: no one to tell)
            pass

    def _release_lock(self) -> None:
        if self._book.writer is not None:
            self._book.writer.release()


def _check_save_call(
    *, step: Any, ignore_policy: Any, force: Any, overwrite: Any, t: Any
) -> tuple[int, bool]:
    out = check(
        SAVE_CALL,
        dict(step=step, ignore_policy=ignore_policy, force=force, overwrite=overwrite, t=t),
    )
    if force is not None:
        _options.warn_deprecated("CheckpointManager.save(force=)", "save(..., ignore_policy=True)")
        if ignore_policy:
            raise OptionError(
                f"force={force!r} and ignore_policy={ignore_policy!r} are one option (force= "
                "is its deprecated name): give ignore_policy= alone"
            )
    return out["step"], bool(out["force"] or out["ignore_policy"])


@contextlib.contextmanager
def _not_saved(step: int) -> Iterator[None]:
    """An earlier save's error raised as ``save(step)`` begins says ``step`` was not saved."""
    try:
        yield
    except Exception as e:
        e.add_note(f"step {step} was not saved: an earlier save's error was raised first")
        raise


_options.document(CheckpointManager, _options.MANAGER_DOC, MANAGER)
