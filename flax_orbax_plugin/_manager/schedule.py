"""SaveSchedule: which steps a manager saves, and when it must stop.

The save policy (``policy.SavePolicy``, frozen) on its clock with the time of the last
save (kept here), a time-based decision taken by the primary and shared with every
process, and the preemption notice (``handle_sigterm``: the step saved before
stopping; see ``preemption``).

Threading: the training thread only. With several processes every process asks
for every step, in order (``should_save`` or ``save`` once per step).
"""

from __future__ import annotations

from .._base import distributed as _distributed
from .policy import SavePolicy
from .preemption import Preemption

__all__ = ["SaveSchedule"]


class SaveSchedule:
    """``policy`` on its clock, the time of the last save, and the preemption notice."""

    def __init__(self, policy: SavePolicy):
        self._policy = policy
        self._last_time: float | None = None  # the last save's (or the first decision's)
        self.preemption: Preemption | None = None  # handle_sigterm (see _preemption)

    def uninstall(self) -> None:
        """The manager's close: the previous SIGTERM handler back (``handle_sigterm``)."""
        if self.preemption is not None:
            self.preemption.uninstall()

    def now(self, t: float | None) -> float:
        return self._policy.clock() if t is None else float(t)

    def _wants(self, step: int, t: float | None) -> bool:
        now = self.now(t)
        if self._last_time is None:
            self._last_time = now  # the first decision starts the clock
        return self._policy.wants(step, elapsed=now - self._last_time)

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (see CheckpointManager.preempted)."""
        return self.preemption is not None and self.preemption.notified

    def preempted_at(self, step: int) -> bool:
        """Whether ``step`` is to be saved before stopping (``handle_sigterm``). With
        several processes it asks jax's preemption sync manager: every process must
        ask for every step, in order (``should_save`` or ``save`` once per step)."""
        return self.preemption is not None and self.preemption.reached(step)

    def should_save(self, step: int, t: float | None) -> bool:
        """This process's view (see CheckpointManager.should_save)."""
        return self.preempted_at(step) or self._wants(step, t)

    def decide(self, step: int, t: float | None) -> bool:
        """The policy's decision; a time-based one is the primary's, shared by all."""
        decide = self._wants(step, t)
        if self._policy.uses_time and _distributed.process_count() > 1:
            op = _distributed.next_operation_id("manager-policy")
            decide = _distributed.broadcast_str(op, str(int(decide))) == "1"
        return decide

    def record_save(self, t: float | None) -> None:
        """A save has started at ``t`` (the clock's time when None)."""
        self._last_time = self.now(t)
