"""What the persistent tier's collaborators share (see ``docs/tiers.md``): the fixed
:class:`Places`, and :class:`TierState`, guarded by its one condition (the training,
save and replicator threads all touch it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from ..._base import env as _env
from ..._base import host_memory as _host_memory
from ..._errors import ReplicationError
from ..._storage.lease import RunOwner
from ..._storage.location import Location
from ..events import Events
from ..retention import KeepRule

# A copy waits while a local save is in flight, but no longer than this per step, so a
# loop that saves all the time still gets its steps replicated.
MAX_DEFER_S = 10.0


class Stopped(Exception):
    """The tier is closing: the copy in progress was abandoned (uncommitted)."""


@dataclasses.dataclass(frozen=True)
class Places:
    """The two places of a tier and what is fixed about them."""

    local: Location
    remote: Location
    retention: KeepRule  # the rule objects (PersistentTier translates keep, keep_every)
    remove_step: Callable[[Location, int], None]
    primary: bool
    multi: bool
    per_host: bool = False  # each host's own local directory (see _manager/per_host.py)
    every: int = 1  # the tier option's every (Tier(every=)): the steps due here
    host_memory: int | str | None = None  # the manager's ceiling (_base.host)
    keep_every: int | None = None  # the steps a newer one never drops from the queue

    def memory_limit(self) -> int | None:
        """The bytes a copy of this tier may hold now (the manager's ``host_memory``)."""
        return _host_memory.resolve(self.host_memory)

    def due(self, step: int) -> bool:
        """Whether ``step`` goes to this tier by its number (``Tier(every=)``)."""
        return step % self.every == 0

    def kept_forever(self, step: int) -> bool:
        return self.keep_every is not None and step % self.keep_every == 0


@dataclasses.dataclass
class TierState:
    """The replication queue and flags, guarded by :attr:`cond` (but :attr:`owner`, set
    before the replicator starts, and the lists kept for tests)."""

    cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    queue: set[int] = dataclasses.field(default_factory=set)
    current: int | None = None
    reading: set[int] = dataclasses.field(default_factory=set)  # being copied down
    known: set[int] = dataclasses.field(default_factory=set)  # committed remotely
    stop: bool = False
    closing_since: float | None = None  # other processes: close() was called
    error: ReplicationError | None = None
    round_steps: set[int] = dataclasses.field(default_factory=set)  # followers: steps in rounds
    owner: RunOwner | None = None  # the primary's, from open()
    events: Events = dataclasses.field(default_factory=Events)  # the manager's, at construction
    replicated: list[int] = dataclasses.field(default_factory=list)  # committed, in order
    # This process's share of each step it helped commit: relative paths (for tests).
    copied_files: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    copied_down: list[int] = dataclasses.field(default_factory=list)  # tried, in order
    # Each host's own directory: the marker a step copied down gets (set once at open).
    marker: Callable[[int], bytes] | None = None
    forced: set[int] = dataclasses.field(default_factory=set)  # replicated whatever every= says
    # A copy up waits while ``busy()``, within MAX_DEFER_S from :meth:`start_yielding`.
    busy: Callable[[], bool] = lambda: False
    defer_until: float = 0.0

    def drop_older(self, step: int, kept_forever: Callable[[int], bool]) -> None:
        """Under ``cond``: drops queued steps older than ``step`` not kept forever."""
        self.queue = {s for s in self.queue if s > step or kept_forever(s)}

    def enqueue(self, step: int, kept_forever: Callable[[int], bool]) -> None:
        """Under ``cond``: queue ``step``, dropping the older steps it supersedes."""
        self.drop_older(step, kept_forever)
        self.queue.add(step)

    def pending(self) -> set[int]:
        """Under ``cond``: the steps queued or being copied."""
        return self.queue | ({self.current} - {None})

    def start_yielding(self) -> None:
        self.defer_until = time.monotonic() + MAX_DEFER_S

    def yield_to_save(self) -> None:
        while not self.stop and time.monotonic() < self.defer_until and self.busy():
            time.sleep(0.005)

    def before_file(self) -> None:
        """Before each file copied up: yield, then the fault point of the tests."""
        self.yield_to_save()
        _env.fail_point("replicate_file")

    def raise_error(self) -> None:
        """Raises the error kept, once (it is cleared)."""
        with self.cond:
            error, self.error = self.error, None
        if error is not None:
            raise error
