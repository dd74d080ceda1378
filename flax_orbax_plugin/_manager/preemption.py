"""Preemption notices: how a writer learns that the run must stop, and at which step.

Training thread only; every process asks ``Preemption.reached`` once per step, for every
step, in increasing order, with the same step numbers.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.preemption``.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from .._base import distributed as _distributed

logger = logging.getLogger("flax_orbax_plugin")


def _sync_manager_available() -> bool:
    from jax._src.distributed import global_state  # private: read when called, not at import

    return global_state.client is not None and global_state.preemption_sync_manager is not None


class Preemption:
    """Whether, and at which step, this run was asked to stop (see the module docstring).

    Create with :meth:`install` (from the main thread); :meth:`reached` is asked once
    per step; :meth:`uninstall` restores the previous SIGTERM handler (``signal`` way).
    """

    def __init__(self, mode: str):
        self.mode = mode  # "signal" or "jax"
        self.notified = False  # signal: SIGTERM arrived; jax: the agreed step came
        self._asked: int | None = None  # the step asked last, and its answer
        self._answer = False
        self._previous: Any = None
        self._installed = False

    @classmethod
    def install(cls) -> Preemption:
        """Chooses the way for this process and installs it. With several processes
        every process calls it (each chooses the same way)."""
        if _distributed.process_count() > 1:
            if _sync_manager_available():
                return cls("jax")
            raise ValueError(
                f"handle_sigterm=True with {_distributed.process_count()} processes needs "
                "jax's preemption service, which is off (jax_enable_preemption_service="
                "False before jax.distributed.initialize): leave that option at its "
                "default (True), so that every host saves the same step on a notice to "
                "any of them, or pass handle_sigterm=False and handle preemption yourself"
            )
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("handle_sigterm=True must be set from the main thread")
        self = cls("signal")
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        return self

    def _on_sigterm(self, signum, frame) -> None:
        self.notified = True

    def reached(self, step: int) -> bool:
        """True when ``step`` is the step to save before stopping. ``jax`` way: asks
        jax once per new step (every process, every step, in order)."""
        if self.mode == "signal":
            return self.notified
        if step == self._asked:
            return self._answer
        from jax.experimental import multihost_utils  # here: only a process that is asked

        self._asked = step
        self._answer = bool(multihost_utils.reached_preemption_sync_point(step))
        if self._answer:
            self.notified = True
        return self._answer

    def uninstall(self) -> None:
        """Puts back the SIGTERM handler that was there before (``signal`` way).
        Idempotent; a no-op off the main thread (the handler then stays)."""
        if not self._installed:
            return
        try:
            signal.signal(signal.SIGTERM, self._previous)
        except ValueError:  # not on the main thread
            return
        self._installed = False
