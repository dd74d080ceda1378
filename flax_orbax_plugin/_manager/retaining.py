"""StepBook: what a manager knows of its steps; RetentionRunner: deletes what retention drops.

Threading: the training, save and deletion threads share one book, every field under
its lock. RetentionRunner: ``submit`` from the save's background thread after each
commit; ``wait`` and ``shutdown`` on the training thread; ``apply`` on the deletion
thread (the training thread for ``gc``).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.retaining``.
"""

from __future__ import annotations

import bisect
import collections
import logging
import numbers
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .._base import distributed as _distributed
from .._base.env import found
from .._base.shown import outside_stacklevel
from .._core import removing as _removing
from .._core.save import SaveResult
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import layout as _layout
from .._format import steps as _steps
from .._storage.deleting import REMOVAL_CONCURRENCY
from .._storage.location import Location
from .checkpointables import checkpointable_for
from .events import Events
from .retention import KeepRule, StepFacts, sound_steps_to_delete
from .tiers import PersistentTier

logger = logging.getLogger("flax_orbax_plugin")
WHILE_SAVING = 2  # deletes in flight on an object store while a save runs


class StepBook:
    """The step records of the manager on ``location`` (the committed steps in memory: a
    save costs the same whatever the number kept); built once the writer's open ran."""

    def __init__(
        self,
        location: Location,
        events: Events,
        *,
        tier: PersistentTier | None = None,
        per_host: bool = False,
        run: str | None = None,
        writer: Any = None,
    ):
        self.location = location
        self.events = events
        self.tier, self.per_host, self.run, self.writer = tier, per_host, run, writer
        self.lock = threading.Lock()  # guards the fields below
        self._reading: collections.Counter[int] = collections.Counter()
        self._deleting: set[int] = set()
        self._metrics: dict[int, dict[str, float | None]] = {}
        self._times: dict[int, float] = {}  # step -> when this manager saved it (its clock)
        self._lanes: dict[int, str | None] = {}  # step -> the lane it was saved in
        self._committed: list[int] | None = None  # a writer's committed steps (steps())
        self._last_save: SaveResult | None = None

    def listed(self) -> list[int]:
        """Committed steps, ascending (not those being deleted), as listed in the store now."""
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
        """A writer's committed steps from its list in memory (listed after :meth:`forget`)."""
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
        """The list in memory may be wrong: the next need lists the store."""
        with self.lock:
            self._committed = None

    def committed(self, step: int, result: SaveResult, metric: dict[str, float | None]) -> None:
        """Background thread, after ``step``'s commit: it joins the list."""
        with self.lock:
            if self._committed is not None and step not in self._committed:
                bisect.insort(self._committed, step)
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
        """False when ``step`` is being read; else it is deleted until :meth:`end_delete`."""
        with self.lock:
            if self._reading[step] > 0:
                return False
            self._deleting.add(step)
            return True

    def end_delete(self, step: int) -> None:
        with self.lock:
            self._deleting.discard(step)
            self._metrics.pop(step, None)

    def metric(self, step: int) -> dict[str, float | None] | None:
        """``step``'s metrics (keep_best), None when not known."""
        with self.lock:
            return self._metrics.get(step)

    def set_metric(self, step: int, value: dict[str, float | None]) -> None:
        with self.lock:
            self._metrics[step] = value

    def note_save(self, step: int, when: float, lane: str) -> None:
        """Training thread, as ``step``'s save begins: its time and lane."""
        with self.lock:
            self._times[step] = when
            self._lanes[step] = lane

    def note_lane(self, step: int, lane: str | None) -> None:
        """The lane an earlier run recorded for ``step`` (None: none)."""
        with self.lock:
            self._lanes.setdefault(step, lane)

    def lane_of(self, step: int) -> str | None:
        with self.lock:
            return self._lanes.get(step)

    def dated(self) -> tuple[dict[int, float], dict[int, str | None]]:
        """``(times, lanes)`` of the steps this manager saved (copies)."""
        with self.lock:
            return dict(self._times), dict(self._lanes)


def as_metric(value: Any) -> float | None:
    """``value`` as a float (a Python, numpy or jax real number); None for anything else."""
    if value is None or isinstance(value, (bool, np.bool_, str, bytes)):
        return None
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # an int beyond any float (10**400): no metric either
            return None
    dtype = getattr(value, "dtype", None)  # numpy/jax scalars (bfloat16's kind is "V")
    if dtype is None or getattr(value, "shape", None) != () or dtype.kind in "bSUO":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class RetentionRunner:
    """Deletes the steps of the manager's directory that its retention does not keep."""

    def __init__(self, opts: Any, book: StepBook, busy: Callable[[], str | None]):
        self._loc = opts.location
        self._busy = busy
        self.policy: KeepRule = opts.retention
        self._metric_names = self.policy.metric_names  # a rule is frozen: asked once
        self._overrides = opts.overrides
        self._book = book
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._waiting: Future | None = None  # the queued pass, not started yet
        self._asked: set[int] = set()  # the steps the queued pass was asked for
        self._last: Future | None = None  # the newest pass (running or queued)
        self._failed: dict[str, str] = {}  # "step N" (or the choice) -> why it failed
        self._unranked: set[str] = set()  # metrics a save lacked (warned of once each)
        self._whole: set[int] = set()  # steps of earlier runs whose manifest read whole
        self._damaged: set[int] = set()  # ... and those whose manifest did not

    def start(self) -> None:
        """The writer's open: the deletion thread (a reader never deletes)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fop-retention")

    def submit(self, just_written: int) -> None:
        """After a commit (background thread): queues a pass (at most one runs, one waits)."""
        if self._pool is None:
            return
        with self._lock:
            self._asked.add(just_written)
            if self._waiting is None:
                self._waiting = self._last = self._pool.submit(self._queued_pass)

    def _queued_pass(self) -> None:
        with self._lock:
            asked, self._asked, self._waiting = self._asked, set(), None
        self.apply(asked)

    def wait(self) -> None:
        """Training thread: drains the queue, then raises naming the steps whose removal failed."""
        fut = self._last
        if fut is not None:
            fut.result()
        self._raise_failures()

    def run_now(self) -> list[int]:
        """``gc``: the queue drained, one pass now, raised like :meth:`wait`; the removed steps."""
        self.wait()
        removed = self.apply(None)
        self._raise_failures()
        return removed

    def _raise_failures(self) -> None:
        with self._lock:
            failed, self._failed = dict(self._failed), {}
        if failed:
            raise CheckpointError(
                f"retention failed in {self._loc} (the next retention pass or gc() tries "
                "again): " + "; ".join(f"{what}: {why}" for what, why in sorted(failed.items()))
            )

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def metric_of(self, extras: Any, step: int) -> dict[str, float | None]:
        """``{name: value}`` of the ranked metrics in ``extras`` (a missing one: warned)."""
        names = self._metric_names
        held = extras if isinstance(extras, Mapping) else {}
        out = {name: as_metric(held.get(name)) for name in names}
        for name in sorted(n for n, v in out.items() if v is None and n not in self._unranked):
            self._unranked.add(name)
            there = (
                f"hold {found(held[name])} there, not a number"
                if name in held
                else f"hold no such key (they hold: {sorted(map(str, held))[:8] or 'nothing'})"
            )
            warnings.warn(
                f"retention ranks steps by extras[{name!r}], but the extras of step {step} "
                f"{there}; such a step is never ranked, and while no step holds it keep_best "
                "ranks nothing and keeps every step (warned once)",
                UserWarning,
                stacklevel=outside_stacklevel(),
            )
        return out

    def metric(self, step: int) -> dict[str, float | None]:
        """``step``'s metrics: known from its save, else read from its extras once."""
        value = self._book.metric(step)
        if value is not None:
            return value
        names = self._metric_names
        value = dict.fromkeys(names)
        try:
            step_loc = _steps.step_location(self._loc, step)
            entry = _layout.read_manifest(step_loc).items.get("extras")
            if entry is not None:
                extras = checkpointable_for("extras", self._overrides).restore(
                    step_loc.child(entry.dir), None
                )
                if isinstance(extras, Mapping):
                    value = {name: as_metric(extras.get(name)) for name in names}
        except CheckpointError as e:  # a damaged step: never deleted nor counted
            logger.warning("retention: cannot read metric of step %d: %s", step, e)
            self._damaged.add(step)
        self._book.set_metric(step, value)
        return value

    def apply(self, just_written: int | Iterable[int] | None) -> list[int]:
        """Deletion thread (or ``gc``): the primary deletes the steps the policy does not
        keep but the newest of ``just_written``, the others drop them from their list."""
        removed: list[int] = []
        if not self.policy.deletes_anything:
            return removed
        # A coalesced pass protects the newest step it was asked for: the older ones
        # would each have been deletable by the pass of the next commit anyway.
        asked = {just_written} if isinstance(just_written, int) else set(just_written or ())
        asked = {max(asked)} if asked else set()
        try:
            doomed = self._doomed(asked)
        except Exception as e:  # kept for wait(): never dropped
            logger.exception("retention failed in %s", self._loc)
            with self._lock:
                self._failed["choosing the steps to delete"] = f"{type(e).__name__}: {e}"
            return removed
        if not (_distributed.is_primary() or self._book.per_host):  # the primary deletes
            for s in doomed:
                self._book.removed(s)
            return removed
        for s in doomed:
            if self._remove(s):
                removed.append(s)
        newest = max(asked) if asked else None
        self._book.events.steps_removed(newest, str(self._loc), removed)  # StepsRemoved
        return removed

    def _remove(self, step: int) -> bool:
        """Removes one doomed step; False when it is being read or its removal failed."""
        if not self._book.begin_delete(step):
            return False
        try:
            _removing.remove_step(self._loc, step, pace=self._pace)
        except _removing.RemainsLeftError as e:  # no longer a step; its files stay
            logger.warning("retention: %s", e)
            self._book.removed(step)
            with self._lock:
                self._failed[f"step {step}"] = str(e).removeprefix(f"step {step} ")
            return True
        except Exception as e:  # noqa: BLE001  (kept for wait(): never dropped)
            if not _steps.step_location(self._loc, step).is_dir():  # removed by someone else
                logger.info("retention: step %d of %s is already gone", step, self._loc)
                self._book.removed(step)
                return False
            logger.warning("retention: cannot delete step %d of %s: %s", step, self._loc, e)
            with self._lock:
                self._failed[f"step {step}"] = f"{type(e).__name__}: {e} (kept and listed)"
            return False
        finally:
            self._book.end_delete(step)
        self._book.removed(step)
        with self._lock:
            self._failed.pop(f"step {step}", None)
            self._failed.pop("choosing the steps to delete", None)
        return True

    def _pace(self) -> int:
        """Deletes in flight on an object store: none, few or many, by the save's phase."""
        busy = self._busy()
        if busy == "blocking":
            return 0
        return WHILE_SAVING if busy else REMOVAL_CONCURRENCY

    def _doomed(self, asked: set[int]) -> list[int]:
        steps = self._book.known()
        facts = self._facts(steps)
        saved_here, _ = self._book.dated()  # committed by this manager: known whole
        # The newest step is kept as well as the one this pass was run for: a pass that
        # runs late must not delete the step a resume would read.
        newest = {max(steps)} if steps else set()
        protected = asked | newest | self._book.being_read()
        tier = self._book.tier
        if tier is not None:  # not yet replicated: kept locally
            protected |= tier.pending_steps()
            if self._book.per_host:  # each host's copy: no due step newer than the bucket
                newest = max(tier.known_steps(), default=-1)
                protected |= {s for s in steps if s > newest and tier.due(s)}
        return sound_steps_to_delete(
            [s for s in steps if s not in self._damaged],  # known damaged: left where they are
            self.policy,
            whole=lambda s: s in saved_here or self._reads_whole(s),
            protected=protected,
            facts=facts,
        )

    def _reads_whole(self, step: int) -> bool:
        """Whether an earlier run's ``step`` manifest reads whole (remembered)."""
        if step in self._whole or step in self._damaged:
            return step in self._whole
        damage = _steps.manifest_damage(self._loc, step)
        if damage is not None:
            logger.warning(
                "retention: step %d of %s is damaged; it is not counted as kept and is "
                "left where it is: %s",
                step,
                self._loc,
                damage,
            )
            self._damaged.add(step)
            return False
        self._whole.add(step)
        return True

    def _facts(self, steps: list[int]) -> StepFacts:
        """What the rules are asked about: metrics, save times, lanes, the latest time."""
        metrics: dict[str, dict[int, float]] = {n: {} for n in self.policy.metric_names}
        if metrics:
            for s in steps:
                for name, value in self.metric(s).items():
                    if value is not None and name in metrics:
                        metrics[name][s] = value
        times, lanes = self._book.dated()
        if getattr(self.policy, "uses_lanes", False):  # an earlier run's: its manifest says
            lanes.update({s: self._lane(s) for s in steps if s not in lanes})
        now = max(times.values(), default=None)
        return StepFacts(metrics=metrics, times=times, lanes=lanes, now=now)

    def _lane(self, step: int) -> str | None:
        """The lane an earlier run recorded in ``step``'s manifest (None: none), read once."""
        try:
            lane = _layout.read_manifest(_steps.step_location(self._loc, step)).lane
        except CheckpointError:  # a damaged step: never deleted (see _reads_whole)
            return None
        self._book.note_lane(step, lane)
        return lane
