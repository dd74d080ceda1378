"""CheckpointCallback: checkpointing for a training loop in three calls.

Who calls what, in which order (all on the training thread)::

    cb = CheckpointCallback(directory, every_steps=500, resume=config.checkpoint.resume)
    state = cb.on_train_start(state, data_iterator=it)   # once, before the first step
    for step in range(int(state.step) + 1, num_steps + 1):
        state = train_step(state, next(it))
        cb.on_step_end(step, state)                       # after every step
    cb.on_train_end(state)                                # once; saves the last step, waits

It also fits a CLU-style hooks list: give it ``state_fn`` (a callable returning the
current state) and call ``cb(step, t=None)`` after each step, as CLU's
``periodic_actions`` are called. ``t`` is the time (``time.monotonic()`` when
None), so tests pass it in instead of sleeping.

The callback owns the save *policy* (every N steps, every T seconds, first call
never saves, the final step always does); the :class:`CheckpointManager` it
creates owns the directory: retention, the writer lock, async writes, commit.

Each finished save's figures reach the user twice: an absl ``logging.info`` line
and, if a ``writer`` is given, ``writer.write_scalars(step, {...})`` (CLU's
metric-writer shape) with ``checkpoint/blocking_seconds``,
``checkpoint/total_seconds``, ``checkpoint/bytes`` and ``checkpoint/gbytes_per_sec``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from absl import logging

from flax_orbax_plugin._errors import CheckpointNotFoundError
from flax_orbax_plugin._manager import SaveFigures

__all__ = ["CheckpointCallback"]


class ScalarWriter(Protocol):
    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...


class CheckpointCallback:
    """Resume at train start, save on a policy, flush at train end.

    Args:
      directory: the checkpoint directory (local path or ``s3://`` / ``gs://`` URL).
      every_steps: save when ``step % every_steps == 0``.
      every_secs: save when at least this many seconds passed since the last save
        (or since the first call). With neither set, only the final step is saved.
      keep: how many of the most recent steps to keep (None keeps all).
      resume: False starts fresh even if checkpoints exist; True resumes from the
        latest step when one exists and starts fresh otherwise; ``"required"``
        raises :class:`CheckpointNotFoundError` when there is nothing to resume.
      async_save: write in the background (the training loop waits only for the
        device-to-host copy). False makes every save durable before returning.
      state_fn: returns the current state; needed only for ``cb(step, t)``.
      data_iterator: an iterator whose position is saved with each step (it may
        also be given to ``on_train_start``).
      extras_fn: ``extras_fn(step, state) -> dict`` of small JSON values saved
        with each step (metrics, for example).
      writer: an object with ``write_scalars(step, scalars)`` receiving each
        save's figures.
      manager_options: further keyword arguments for :class:`CheckpointManager`.
    """

    def __init__(
        self,
        directory: str,
        *,
        every_steps: int | None = None,
        every_secs: float | None = None,
        keep: int | None = 3,
        resume: bool | str = False,
        async_save: bool = True,
        state_fn: Callable[[], Any] | None = None,
        data_iterator: Any = None,
        extras_fn: Callable[[int, Any], Mapping[str, Any]] | None = None,
        writer: ScalarWriter | None = None,
        manager_options: Mapping[str, Any] | None = None,
    ):
        if not (resume is True or resume is False or resume == "required"):
            raise ValueError(f"resume must be False, True or 'required', found {resume!r}")
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"every_steps must be a positive int or None, found {every_steps!r}")
        if every_secs is not None and not every_secs > 0:
            raise ValueError(f"every_secs must be > 0 or None, found {every_secs!r}")
        self.directory = directory
        self.every_steps = every_steps
        self.every_secs = every_secs
        self.keep = keep
        self.resume = resume
        self.async_save = bool(async_save)
        self._state_fn = state_fn
        self._data_iterator = data_iterator
        self._extras_fn = extras_fn
        self._writer = writer
        self._manager_options = dict(manager_options or {})
        self._manager = None
        self._last_save_time: float | None = None
        self._last_saved_step: int | None = None
        self._last_step: int | None = None
        self._inflight: int | None = None  # the step saving in the background
        self.history: list[SaveFigures] = []  # figures of every finished save, in order
        self.resumed_step: int | None = None  # the step restored by on_train_start

    # -- the manager ------------------------------------------------------------

    @property
    def manager(self):
        """The CheckpointManager, created on first use."""
        if self._manager is None:
            from flax_orbax_plugin._manager import CheckpointManager

            self._manager = CheckpointManager(self.directory, **self._manager_kwargs())
        return self._manager

    def _manager_kwargs(self) -> dict[str, Any]:
        kwargs = dict(keep=self.keep, async_save=self.async_save)
        kwargs.update(self._manager_options)
        return kwargs

    # -- the three hooks --------------------------------------------------------

    def on_train_start(
        self, state: Any, data_iterator: Any = None, *, reset: tuple[str, ...] = ()
    ) -> Any:
        """Returns ``state`` resumed from the latest step (per ``resume``), or unchanged.

        ``reset`` names items kept from ``state`` instead of restored, e.g.
        ``reset=("opt_state",)`` after changing the optimizer: params, step, other
        items and the data position are resumed, the optimizer starts fresh.
        """
        from flax_orbax_plugin._resume import items_to_restore
        from flax_orbax_plugin._train_state import merge_state

        if data_iterator is not None:
            self._data_iterator = data_iterator
        names = items_to_restore(state, reset=reset) if reset else None
        mngr = self.manager
        latest = mngr.latest_step() if self.resume else None
        if latest is None:
            if self.resume == "required":
                raise CheckpointNotFoundError(
                    f"resume='required' but {self.directory} holds no committed checkpoint"
                )
            if self.resume:
                logging.info("checkpoint: nothing to resume in %s; starting fresh", self.directory)
            return state
        t0 = time.perf_counter()
        if names is None:
            restored = mngr.restore(like=state, step=latest, data_iterator=self._data_iterator)
        else:
            subset = mngr.restore(
                like=state, step=latest, items=names, data_iterator=self._data_iterator
            )
            restored = merge_state(state, subset)
        self.resumed_step = self._last_saved_step = self._last_step = int(latest)
        logging.info(
            "checkpoint: resumed step %d from %s in %.3f s",
            latest,
            self.directory,
            time.perf_counter() - t0,
        )
        return restored

    def on_step_end(self, step: int, state: Any, *, t: float | None = None) -> bool:
        """Saves ``state`` as ``step`` if the policy says so; returns whether it did."""
        step = int(step)
        now = time.monotonic() if t is None else float(t)
        self._last_step = step
        self._poll()
        if self._last_save_time is None:
            # The first call starts the clock (as CLU's periodic actions do).
            self._last_save_time = now
        due = (self.every_steps is not None and step % self.every_steps == 0) or (
            self.every_secs is not None and now - self._last_save_time >= self.every_secs
        )
        if not due or step == self._last_saved_step:
            return False
        self._save(step, state)
        self._last_save_time = now
        return True

    def on_train_end(self, state: Any, step: int | None = None) -> None:
        """Saves the final step (unless already saved), waits for it, and closes."""
        if step is None:
            step = _step_of(state, self._last_step)
        if step is not None and int(step) != self._last_saved_step:
            self._save(int(step), state)
        self.close()

    def __call__(self, step: int, t: float | None = None) -> bool:
        """CLU-style hook: reads the state from ``state_fn`` and calls ``on_step_end``."""
        if self._state_fn is None:
            raise TypeError("CheckpointCallback(...) needs state_fn=... to be used as a hook")
        return self.on_step_end(step, self._state_fn(), t=t)

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is durable; reports its figures."""
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

    def __exit__(self, *exc):
        self.close()

    # -- saving and reporting ----------------------------------------------------

    def _save(self, step: int, state: Any) -> None:
        self._finish_inflight(block=True)
        extras = dict(self._extras_fn(step, state)) if self._extras_fn else None
        self.manager.save(step, state, data_iterator=self._data_iterator, extras=extras, force=True)
        self._last_saved_step = step
        self._inflight = step
        if not self.async_save:
            self._finish_inflight(block=True)

    def _poll(self) -> None:
        self._finish_inflight(block=False)

    def _finish_inflight(self, *, block: bool) -> None:
        """Reports the figures of the save in flight once it is committed.

        With ``block`` False, returns at once if the save is still running. A save
        that failed in the background raises here (through the manager) and reports
        no figures.
        """
        if self._inflight is None:
            return
        if not block and self.manager.save_in_flight:
            return
        step, self._inflight = self._inflight, None
        self.manager.wait()  # re-raises a background error
        figures = self.manager.last_save
        if figures is None or figures.step != step:
            return
        self.history.append(figures)
        logging.info(
            "checkpoint: saved step %d: blocking %.4f s, total %.4f s, %d bytes, %.3f GB/s",
            figures.step,
            figures.blocking_seconds,
            figures.total_seconds,
            figures.bytes_written,
            figures.gbytes_per_sec,
        )
        if self._writer is not None:
            self._writer.write_scalars(step, figures.as_scalars())


def _step_of(state: Any, default: int | None) -> int | None:
    step = getattr(state, "step", None)
    if step is None:
        return default
    try:
        return int(step)
    except TypeError:
        return default
