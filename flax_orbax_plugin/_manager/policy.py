"""Save policy: whether CheckpointManager.save writes a given step.

A step is saved when any rule fires: it is in ``steps``; it is a multiple of
``every_steps``; at least ``every_seconds`` have passed since the last save (or since
the first decision: the first call starts the clock, as CLU's periodic actions do).
With no rule set every call saves. ``force`` overrides the policy. The time is passed
in (the manager's clock, or ``t`` from the caller) so tests need no sleeps.

The one policy of the library: the callback hands its options to the manager, which
decides once and, for a time-based rule with several processes, shares the primary's
decision with every process.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SavePolicy"]


class SavePolicy:
    """Decides which steps to save. Not thread-safe: the training thread owns it."""

    def __init__(
        self,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        steps: Iterable[int] | None = None,
    ):
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"every_steps must be a positive int, found {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0, found {every_seconds!r}")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.steps = frozenset(int(s) for s in steps) if steps is not None else frozenset()
        self._last_time: float | None = None

    @property
    def always(self) -> bool:
        return self.every_steps is None and self.every_seconds is None and not self.steps

    def should_save(self, step: int, now: float) -> bool:
        if self._last_time is None:
            self._last_time = now  # the first decision starts the clock
        if self.always or step in self.steps:
            return True
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if self.every_seconds is not None:
            return now - self._last_time >= self.every_seconds
        return False

    def record_save(self, now: float) -> None:
        """Called by the manager once a save has started."""
        self._last_time = now
