"""StepBook: what one CheckpointManager knows about its steps, under one lock.

The committed steps of a writer (a list in memory, so that a save costs the same
whatever the number of steps kept), the steps being read (never deleted by this
manager's retention) and being deleted (never read), the metrics of each step for
``keep_best`` (``{name: value}``), when this manager saved each step and in which lane
(``KeepFor``, ``Lanes``), the figures of the last save, the persistent tier if any, and
where events go.

Threading: the training thread, the save's background thread and the deletion
thread all use one book; every field is read and changed under its lock.
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Callable
from typing import Any

from .._core.save import SaveResult
from .._errors import CheckpointNotFoundError
from .._format import steps as _steps
from .._storage.location import Location
from .events import Events
from .tiers import PersistentTier

__all__ = ["StepBook"]


class StepBook:
    """The step records of the manager on ``location`` (see the module docstring)."""

    def __init__(self, location: Location, *, on_event: Callable[[Any], Any] | None = None):
        self.location = location
        self.tier: PersistentTier | None = None  # set once, when the manager opens it
        # Set once at open: each host has its own directory (see per_host), and the run
        # owning the places (the primary's, shared), which each host's marker names.
        self.per_host = False
        self.run: str | None = None
        self.writer: Any = None  # the writer's lock or lease (set at open; before_commit)
        self.events = Events(on_event)  # where every collaborator's events go
        self.lock = threading.Lock()  # guards the fields below
        self._reading: collections.Counter[int] = collections.Counter()
        self._deleting: set[int] = set()
        self._metrics: dict[int, dict[str, float | None]] = {}
        self._times: dict[int, float] = {}  # step -> when this manager saved it (its clock)
        self._lanes: dict[int, str | None] = {}  # step -> the lane it was saved in
        self._committed: list[int] | None = None  # a writer's committed steps (steps())
        self._last_save: SaveResult | None = None

    # -- committed steps

    def listed(self) -> list[int]:
        """Committed steps, ascending (steps being deleted are left out), as listed in
        the store now. A save never calls it: see :meth:`known`."""
        steps = _steps.committed_steps(self.location)
        with self.lock:
            return [s for s in steps if s not in self._deleting]

    def latest(self, *, include_persistent: bool) -> int | None:
        """The highest listed step; with ``include_persistent``, of either tier."""
        steps = self.listed()
        if include_persistent and self.tier is not None:
            steps = sorted(set(steps) | set(self.tier.steps()))
        return steps[-1] if steps else None

    def known(self) -> list[int]:
        """A writer's committed steps, from its list in memory (steps being deleted left
        out): what ``save`` and retention use, so that a save costs the same whatever
        the number of steps kept. Listed from the store at the first need and again
        after a failed commit (or anything else that makes it unsure); kept up to date
        by this manager's own commits and removals. Any thread."""
        with self.lock:
            known = self._committed
        if known is None:
            listed = _steps.committed_steps(self.location)
            with self.lock:
                if self._committed is None:
                    self._committed = listed
                known = self._committed
        with self.lock:
            return [s for s in known if s not in self._deleting]

    def forget(self) -> None:
        """The list in memory may be wrong (a failed commit, a removal by someone
        else, a copy from the persistent tier): the next need lists the store."""
        with self.lock:
            self._committed = None

    def committed(self, step: int, result: SaveResult, metric: dict[str, float | None]) -> None:
        """Background thread, after ``step``'s commit: it joins the list."""
        with self.lock:
            if self._committed is not None and step not in self._committed:
                bisect.insort(self._committed, step)
        with self.lock:
            self._metrics[step] = metric
            self._last_save = result

    def removed(self, step: int) -> None:
        with self.lock:
            self._times.pop(step, None)
            self._lanes.pop(step, None)
            if self._committed is not None and step in self._committed:
                self._committed.remove(step)

    @property
    def last_save(self) -> SaveResult | None:
        with self.lock:
            return self._last_save

    # -- reading and deleting

    def begin_read(self, step: int) -> None:
        """``step`` is being read (not deleted meanwhile); pair with :meth:`end_read`."""
        with self.lock:
            if step in self._deleting:
                raise CheckpointNotFoundError(f"step {step} of {self.location} is being deleted")
            self._reading[step] += 1

    def end_read(self, step: int) -> None:
        with self.lock:
            self._reading[step] -= 1

    def being_read(self) -> set[int]:
        with self.lock:
            return set(+self._reading)

    def begin_delete(self, step: int) -> bool:
        """False when ``step`` is being read; else it is being deleted until
        :meth:`end_delete`."""
        with self.lock:
            if self._reading[step] > 0:
                return False
            self._deleting.add(step)
            return True

    def end_delete(self, step: int) -> None:
        with self.lock:
            self._deleting.discard(step)
            self._metrics.pop(step, None)

    # -- metrics (keep_best)

    def metric(self, step: int) -> tuple[bool, dict[str, float | None]]:
        """``(known, {name: value})``: whether ``step``'s metrics are known, and them."""
        with self.lock:
            if step in self._metrics:
                return True, self._metrics[step]
        return False, {}

    def set_metric(self, step: int, value: dict[str, float | None]) -> None:
        with self.lock:
            self._metrics[step] = value

    # -- save times and lanes (KeepFor, Lanes)

    def note_save(self, step: int, when: float, lane: str) -> None:
        """Training thread, as ``step``'s save begins: its time (the schedule's, the
        primary's with several processes when time matters) and its lane."""
        with self.lock:
            self._times[step] = when
            self._lanes[step] = lane

    def note_lane(self, step: int, lane: str | None) -> None:
        """Any thread: the lane an earlier run recorded for ``step`` (its manifest; None:
        it recorded none, and its number says)."""
        with self.lock:
            self._lanes.setdefault(step, lane)

    def lane_of(self, step: int) -> str | None:
        """The lane ``step`` was saved in (None: not known)."""
        with self.lock:
            return self._lanes.get(step)

    def dated(self) -> tuple[dict[int, float], dict[int, str | None]]:
        """``(times, lanes)`` of the steps this manager saved (copies)."""
        with self.lock:
            return dict(self._times), dict(self._lanes)
