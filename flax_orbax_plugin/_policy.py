"""Save policy: whether CheckpointManager.save writes a given step.

A step is saved when any rule fires: it is in ``steps``; it is a multiple of
``every_steps``; at least ``every_seconds`` have passed since the last save (or
since the policy was created). With no rule set every call saves. ``force``
overrides the policy. Time comes from ``clock`` so tests pass it in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["SavePolicy"]


class SavePolicy:
    """Decides which steps to save. Not thread-safe: the training thread owns it."""

    def __init__(
        self,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        steps: Iterable[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"save_every_steps must be a positive int, found {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"save_every_seconds must be > 0, found {every_seconds!r}")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.steps = frozenset(int(s) for s in steps) if steps is not None else frozenset()
        self._clock = clock
        self._last_time = clock()

    @property
    def always(self) -> bool:
        return self.every_steps is None and self.every_seconds is None and not self.steps

    def should_save(self, step: int) -> bool:
        if self.always or step in self.steps:
            return True
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if self.every_seconds is not None:
            return self._clock() - self._last_time >= self.every_seconds
        return False

    def record_save(self) -> None:
        """Called by the manager once a save has started."""
        self._last_time = self._clock()
