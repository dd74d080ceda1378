"""SaveSchedule: which steps a manager saves, and when it must stop.

The save policy (a frozen ``save_rules.SaveRule``; a ``SavePolicy`` stands for its
``rule``) on the manager's clock, with what it is asked about kept here: the time the
last save began and how long it blocked the loop (:class:`~.save_rules.Moment`). A
decision that depends on the time or on the save in flight (``uses_time``, or a
retention that dates steps) is the primary's, shared with every process together with
its time (the step's save time is then the same everywhere). The preemption notice
(``handle_sigterm``, or an ``OnPreemption`` policy: see ``preemption``) answers which
step is the one to save before stopping.

Threading: the training thread only. With several processes every process asks
for every step, in order (``should_save`` or ``save`` once per step).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .._base import distributed as _distributed
from .policy import SavePolicy
from .preemption import Preemption
from .save_rules import Moment, SaveRule

__all__ = ["FORCED", "SaveSchedule"]

FORCED = "forced"  # the label of a step saved whatever the policy says


class SaveSchedule:
    """``policy`` on its clock, the last save's time and blocking time, the notice.

    ``clock``: the time source (a SavePolicy's own ``clock`` wins); ``shares_time``:
    the decision and its time are the primary's even when the policy does not use the
    time (a retention by age). ``context()``: ``(has_steps, in_flight)`` for each
    decision (the manager's: a committed step is known, a save's background phase
    runs)."""

    def __init__(
        self,
        policy: SaveRule,
        clock: Callable[[], float] = time.monotonic,
        shares_time: bool = False,
    ):
        if isinstance(policy, SavePolicy):  # its own clock, when it has one, wins
            policy, clock = policy.rule, clock if policy.clock is time.monotonic else policy.clock
        self._rule = policy
        self.clock = clock
        self._shares = policy.uses_time or shares_time
        self._last_time: float | None = None  # the last save's (or the first decision's)
        self._last_blocking: float | None = None
        self._saved_any = False  # this schedule recorded a save
        self._preemption_saved = False  # OnPreemption saves the agreed step once
        self.preemption_step: int | None = None  # the step saved for it (replicated)
        self.context: Callable[[], tuple[bool, bool]] = lambda: (False, False)
        self.preemption: Preemption | None = None  # see preemption
        self.stops = False  # handle_sigterm: the preemption step's save ends the run

    @property
    def watches_preemption(self) -> bool:
        """Whether the policy saves on preemption (the manager installs the notice)."""
        return self._rule.watches_preemption

    def watch(self, *, handle_sigterm: bool) -> None:
        """A writer's open (main thread): installs the preemption notice when
        ``handle_sigterm`` (then the notice's step ends the run) or the policy saves on
        preemption (``OnPreemption``)."""
        if handle_sigterm or self.watches_preemption:
            self.preemption = Preemption.install()
            self.stops = handle_sigterm

    def uninstall(self) -> None:
        """The manager's close: the previous SIGTERM handler back (``handle_sigterm``)."""
        if self.preemption is not None:
            self.preemption.uninstall()

    def resume_clock(self, saved_at: Callable[[], float | None]) -> None:
        """A writer's open: a time rule (``every_seconds``) counts from the latest
        step's save (``saved_at()``: its wall time, None without one), not from this
        process's first decision, so that a job restarted more often than its interval
        still saves. The default clock only (its age is carried over); a clock of the
        user's starts at the first decision, as before."""
        if self._rule.uses_time and self.clock is time.monotonic and self._last_time is None:
            when = saved_at()
            if when is not None:
                self._last_time = self.clock() - max(0.0, time.time() - when)

    def now(self, t: float | None) -> float:
        return self.clock() if t is None else float(t)

    def _moment(self, step: int, t: float | None) -> Moment:
        now = self.now(t)
        if self._last_time is None:
            self._last_time = now  # the first decision starts the clock
        has_steps, in_flight = self.context()
        return Moment(
            step,
            now=now,
            since_save=now - self._last_time,
            has_steps=has_steps or self._saved_any,  # a save in flight counts
            in_flight=in_flight,
            preempted=self.preempted_at(step) and not self._preemption_saved,
            last_blocking=self._last_blocking,
        )

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
        if self.stops and self.preempted_at(step):
            return True
        return self._rule.label(self._moment(step, t)) is not None

    def decide(
        self,
        step: int,
        t: float | None,
        *,
        forced: bool = False,
        region: _distributed.Region | None,
    ) -> tuple[str | None, float]:
        """``(label, now)``: the lane ``step`` is saved in (``"save"`` outside lanes,
        :data:`FORCED` for a step saved whatever the policy says) or None, and the time
        of the decision; a time-based one is the primary's, shared by all, with its time
        (in ``region``, the manager save's)."""
        moment = self._moment(step, t)
        label = self._rule.label(moment)
        if forced and label is None:
            label = FORCED
        now = moment.now
        if self._shares and _distributed.process_count() > 1:
            op = _distributed.next_operation_id("manager-policy", region=region)
            text = _distributed.broadcast_str(op, f"{label or ''}|{now!r}", region=region)
            shared, _, when = text.partition("|")
            label, now = shared or None, float(when)
        if label is not None and moment.preempted:
            self._preemption_saved, self.preemption_step = True, step
        return label, now

    def record_save(self, now: float | None, blocking: float | None = None) -> None:
        """A save began at ``now`` (the clock's time when None) and blocked the loop for
        ``blocking`` seconds (on the clock)."""
        self._last_time = self.now(now)
        self._last_blocking, self._saved_any = blocking, True
