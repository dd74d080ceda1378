"""CheckpointCallback: checkpointing for a training loop in three calls, all on the training
thread, in order: ``on_train_start`` once, ``on_step_end`` after every step (or ``cb(step)``
in a CLU hooks list), ``on_train_end`` once.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.callback``.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from .._base import distributed as _distributed
from .._core.save import SaveResult
from .._errors import CheckpointError, EventHookError, OptionTypeError
from .._format.steps import STEP, checked_step
from .._like.onto_like import changes as check_changes
from .._state.iterators import check_iterator
from .._state.resume import check_reset, items_to_restore
from .._state.train_state import merge_state
from .._storage.store_errors import arguments, refusals
from . import options as _options
from . import resuming as _resuming
from .manager import CheckpointManager
from .options import CALLBACK

logger = logging.getLogger("flax_orbax_plugin")


@_distributed.public(errors=refusals(arguments("directory")))  # its manager names the rest
class CheckpointCallback:
    # __init__'s docstring and signature: from options.CALLBACK (options.document)

    def __init__(self, directory: str, **options: Any):
        # Refused on some processes only: said in the region the others' manager open draws.
        try:
            values, self._manager_options = _options.check_callback(options, directory)
        except Exception:
            with _distributed.collective("manager-open"):
                raise
        self.directory = directory
        self.every_steps = values["every_steps"]
        self.every_seconds = values["every_seconds"]
        self.keep = values["keep"]
        self.resume = values["resume"]
        self.overwrite = values["overwrite"]
        self.async_save = values["async_save"]
        self._warned_step = False
        self._state_fn = values["state_fn"]
        self._data_iterator = values["data_iterator"]
        self._extras_fn = values["extras_fn"]
        self._writer = values["writer"]
        self._on_event = values["on_event"]
        self._manager = None
        self._last_saved_step: int | None = None
        self._last_step: int | None = None
        self._stepped: int | None = None  # the first step on_step_end was called with
        self._started = False  # on_train_start ran (it resumes, or checks resume=False)
        self._ended: int | None = None  # the step on_train_end saved (-1: none)
        self._inflight: int | None = None  # the step saving in the background
        self._inflight_handle = None  # its SaveHandle (the manager's), if not committed
        self.history: list[SaveResult] = []  # figures of every finished save, in order
        self.resumed_step: int | None = None  # the step restored by on_train_start

    @property
    def manager(self) -> CheckpointManager:
        """The CheckpointManager, created on first use (with the callback's ``keep``,
        ``every_steps``, ``every_seconds``, ``async_save`` and ``manager_options``)."""
        if self._manager is None:
            if self._ended is not None:  # a writer again, for a run that is over
                raise CheckpointError(
                    f"{self.directory}: this callback's run is over (on_train_end, step "
                    f"{self._ended}) and its manager closed; read the run with "
                    f"fop.CheckpointManager(directory, read_only=True)"
                )
            self._manager = CheckpointManager(self.directory, **self._manager_options)
            if self._writer is not None or self._on_event is not None:
                self._manager.commit_log_level = logging.DEBUG  # the writer or hook reports it
        return self._manager

    def on_train_start(
        self,
        state: Any,
        data_iterator: Any = None,
        *,
        reset: tuple[str, ...] = (),
        partial: bool = False,
        missing: str = "error",
        transform: Any = None,
        surgery: Any = None,
    ) -> Any:
        """Returns ``state`` resumed from the latest good step (per ``resume``), or
        unchanged. With ``resume=False`` a directory holding steps is refused (or, with
        ``overwrite=True``, emptied of them).

        ``reset`` names items kept from ``state`` instead of restored, e.g.
        ``reset=("opt_state",)`` after changing the optimizer: params, step, other
        items and the data position are resumed, the optimizer starts fresh;
        ``reset=("data_iterator",)`` starts the data afresh on purpose. Resuming a step
        that holds a data position without a ``data_iterator`` warns once (the run would
        replay its data).

        ``partial``, ``missing``, ``transform`` and ``surgery`` resume into a changed
        model, as in :meth:`CheckpointManager.restore` (e.g. ``missing="keep"`` for a model that
        grew layers: the new ones keep their values from ``state``). ``surgery`` names
        params' paths: it applies to params as given and, in the other items, at every
        prefix that mirrors them (Adam's ``0/mu/``, ``0/nu/``), where an operation that
        finds nothing does nothing (``_like/surgery.py``). Then reserves the
        manager's host buffers for saving the state (:meth:`CheckpointManager.reserve`).
        """
        if self._stepped is not None:  # else its own steps read as an earlier run's
            raise CheckpointError(
                f"on_train_start after on_step_end (step {self._stepped}) of this run: "
                f"call on_train_start(state) once, before the training loop"
            )
        if data_iterator is not None:
            if self._data_iterator not in (None, data_iterator):  # one would be dropped
                raise CheckpointError(
                    "data_iterator given twice, to CheckpointCallback(...) and to "
                    "on_train_start(...), as two iterators: give the one to save once"
                )
            self._data_iterator = check_iterator(data_iterator)
        reset = check_reset(reset)
        self._started = True
        changes = dict(partial=partial, missing=missing, transform=transform, surgery=surgery)
        opts = check_changes(**changes).kwargs()
        try:
            state = self._resume(state, reset, opts)
            self.manager.reserve(state)
        except BaseException as e:  # the lock goes with it: a corrected retry may open again
            if self._manager is not None:
                self._manager.leave(e)
                self._manager = None
            raise
        return state

    def _resume(self, state: Any, reset: tuple[str, ...], opts: dict) -> Any:
        names = items_to_restore(state, reset=reset) if reset else None
        existed = self._manager is not None or _resuming.place_exists(self.directory)
        created = [] if existed else _resuming.created_by_open(self.directory)
        mngr = self.manager
        latest = mngr.latest_step(include_persistent=True)
        if not self.resume:
            if latest is not None:
                _resuming.refuse_or_clear(self.directory, mngr, latest, self.overwrite)
            return state
        if latest is None:
            try:
                _resuming.no_run_to_resume(self.directory, mngr, self.resume, existed)
            except CheckpointError:
                if not existed:  # a mistyped path: the directory the open made goes again
                    self._manager = None
                    _resuming.remove_created(self.directory, mngr, created)
                raise
            return state
        t0 = time.perf_counter()
        if names is None:
            restored = mngr.restore(like=state, data_iterator=self._data_iterator, **opts)
        else:
            it = None if "data_iterator" in reset else self._data_iterator
            subset = mngr.restore(like=state, items=names, data_iterator=it, **opts)
            restored = merge_state(state, subset)
        if self._data_iterator is None and "data_iterator" not in reset:
            mngr.warn_data_replay()  # a resume that replays data
        latest = mngr.restored_step
        self.resumed_step = self._last_saved_step = self._last_step = latest
        took = time.perf_counter() - t0
        logger.info("checkpoint: resumed step %s from %s in %.3f s", latest, self.directory, took)
        return restored

    def on_step_end(self, step: int, state: Any, *, t: float | None = None) -> bool:
        """Saves ``state`` as ``step`` if the policy says so; returns whether it did."""
        step = STEP.check(step)  # its declaration's check (checked_step's), asked directly
        if self._ended is not None:  # it would reopen the manager for a save nobody waits for
            raise self._run_over(f"on_step_end({step})")
        if self._stepped is None and not self._started:  # a CLU hook list's cb(step) alone
            _resuming.unstarted(self.directory, self.manager, step, self.resume, self.overwrite)
        self._last_step = step
        self._stepped = step if self._stepped is None else self._stepped
        self._finish_inflight(block=False)
        if step == self._last_saved_step:
            # Already saved; still asked about preemption (every step, on every process).
            if self.manager.preempted_at(step):
                self.close()
                raise SystemExit(128 + signal.SIGTERM)
            return False
        return self._save(step, state, t=t, ignore_policy=False)

    def on_train_end(self, state: Any = None, step: int | None = None) -> None:
        """Saves the final step (unless already saved), waits for it, and closes; then
        raises the first error of an ``on_event`` hook not raised yet. ``state``: the
        final state (default: ``state_fn()``, for a callback used as a hook)."""
        state = self._hook_state() if state is None else state
        if step is None:  # from state.step: a stale one is refused, said (resuming)
            _resuming.stale_step(_step_of(state, None), self._last_saved_step, self._last_step)
        step = _step_of(state, self._last_step) if step is None else checked_step(step)
        if self._ended is not None:  # twice: the same end is nothing, another refused
            if step is None or int(step) == self._ended:
                return
            raise self._run_over(f"on_train_end(step {step})")
        self._ended = -1 if step is None else int(step)
        first = None  # a hook's error raised by the last save (its step is saved all the same)
        if step is not None and int(step) != self._last_saved_step:
            try:
                self._save(int(step), state, t=None, ignore_policy=True)
            except EventHookError as e:
                first = e
        try:
            self.close()
        except EventHookError:
            if first is None:
                raise
        if first is not None:  # once closed; a later hook error was logged
            raise first

    def _run_over(self, call: str) -> CheckpointError:
        over = f"after on_train_end (step {self._ended}): this callback's run is over"
        return CheckpointError(f"{call} {over}; use a new CheckpointCallback for another run")

    def __call__(self, step: int, t: float | None = None) -> bool:
        """CLU-style hook: reads the state from ``state_fn`` and calls ``on_step_end``."""
        return self.on_step_end(step, self._hook_state(), t=t)

    def _hook_state(self) -> Any:
        if self._state_fn is None:
            raise OptionTypeError(
                "this callback was made without state_fn=, so it cannot be called as a "
                "hook (cb(step) or cb.on_train_end() with no state): pass "
                "state_fn=lambda: state, or call cb.on_step_end(step, state)"
            )
        return self._state_fn()

    def wrap_step(self, fn: Any, **options: Any) -> Any:
        """The manager's :meth:`CheckpointManager.wrap_step`: ``step =
        cb.wrap_step(train_step, donate_argnums=0)``; this callback's saves then copy
        nothing, and the step after each writes into the previous save's arrays."""
        return self.manager.wrap_step(fn, **options)

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is durable and retention has run;
        reports its figures. With several processes: on every process (collective)."""
        if self._manager is not None:
            self._finish_inflight(block=True)
            self._manager.wait()

    def close(self) -> None:
        """Waits for the save in flight and releases the directory."""
        if self._manager is not None:
            try:
                self.wait()
            finally:
                self._manager.close()
                self._manager = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Closes; with an error leaving the block, the manager's ``leave``: the save in
        flight ends, then the other processes learn that this one left (none waits)."""
        if exc_type is None or self._manager is None:
            self.close()
            return
        try:
            self._finish_inflight(block=True)
        except BaseException:  # the block's error goes on; this one is logged
            logger.exception("checkpoint: the save in flight failed while leaving")
        finally:
            self._manager.leave(exc)
            self._manager = None

    def _save(self, step: int, state: Any, *, t: float | None, ignore_policy: bool) -> bool:
        # No wait here: the manager waits for the save in flight when it starts the next.
        self._finish_inflight(block=False)
        stepped = _step_of(state, None)
        if stepped is not None and stepped != step and not self._warned_step:
            self._warned_step = True
            logger.warning(
                "checkpoint: saving step %d but state.step is %d (a 0-based loop counter?); "
                "the step number is the directory name restore resumes from",
                step,
                stepped,
            )
        extras_fn = self._extras_fn
        try:
            saved = self.manager.save(
                step,
                state,
                data_iterator=self._data_iterator,
                extras=(lambda: extras_fn(step, state)) if extras_fn else None,  # checked there
                ignore_policy=ignore_policy,
                t=t,
            )
        except EventHookError as e:  # an earlier event's hook: this step may be saved
            if getattr(e, "saved_step", None) == step:
                self._saved(step)
            raise
        if saved:
            self._saved(step)
        return saved

    def _saved(self, step: int) -> None:
        previous, handle = self._inflight, self._inflight_handle  # the save before: reported
        self._last_saved_step, self._inflight = step, step
        self._inflight_handle = self.manager.pending_save  # None: already committed
        if previous is not None:
            self._finish(previous, handle)
        if not self.async_save:
            self._finish_inflight(block=True)

    def _finish_inflight(self, *, block: bool) -> None:
        """Reports the save in flight once committed (``block`` False: not if it runs).
        This process's own wait, never the collective ``wait`` (the others do not poll)."""
        if self._inflight is None:
            return
        handle = self._inflight_handle
        if not block and handle is not None and not handle.done():
            return
        step, self._inflight, self._inflight_handle = self._inflight, None, None
        self._finish(step, handle)

    def _finish(self, step: int, handle: Any) -> None:
        if handle is None:  # a synchronous save: committed within manager.save
            figures = self.manager.last_save
        elif handle is self.manager.pending_save:
            self.manager.wait_for_save()  # re-raises a background error (once)
            if handle.error is not None:  # reported already (a cancel(): never again)
                return
            figures = handle.wait()
        else:  # the manager waited for it when it started the next save
            try:
                figures = handle.wait()
            except Exception:  # noqa: BLE001  (the manager has raised it already; a Ctrl-C goes on)
                return
        if figures is None or figures.step != step:
            return
        self.history.append(figures)
        try:
            if self._writer is not None:
                self._writer.write_scalars(step, figures.as_scalars())
        except Exception as e:  # as an on_event hook's: the step is saved all the same
            what = f"{type(e).__name__}: {e} on step {step} of {self.directory}"
            raise EventHookError(f"writer.write_scalars raised {what} (saved all the same)") from e


def _step_of(state: Any, default: int | None) -> int | None:
    step = getattr(state, "step", None)
    if step is None or callable(step):  # no step field (a method of that name is none)
        return default
    return checked_step(step)


_options.document(CheckpointCallback, _options.CALLBACK_DOC, CALLBACK)
