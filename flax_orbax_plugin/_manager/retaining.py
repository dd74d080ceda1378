"""RetentionRunner: applies a manager's retention policy to its directory.

Which steps go is ``retention.steps_to_delete`` (pure); this runs it on the steps a
manager knows (its :class:`StepBook`), with the metric of each step for
``keep_best`` (from the save's extras, else read back from the step), and deletes
the doomed steps through ``_ownership.remove_step`` (the primary only).

Threading and call order: ``start`` (the writer's open) creates the one deletion
thread; each commit calls ``submit`` from the save's background thread; ``wait``
and ``shutdown`` are the training thread's (``wait``, ``close``); ``apply`` runs on
the deletion thread, or on the training thread for ``gc``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._base import distributed as _distributed
from .._core import ownership as _ownership
from .._errors import CheckpointError
from .._format import steps as _steps
from .._storage.location import Location
from .book import StepBook
from .checkpointables import Checkpointable, checkpointable_for
from .retention import Retention, steps_to_delete

__all__ = ["RetentionRunner", "as_metric"]

logger = logging.getLogger("flax_orbax_plugin")


def as_metric(value: Any) -> float | None:
    """``value`` as a float; None for no value or one that is not a number."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class RetentionRunner:
    """Deletes the steps of ``location`` that ``policy`` does not keep."""

    def __init__(
        self,
        location: Location,
        policy: Retention,
        overrides: Mapping[str, Checkpointable],
        book: StepBook,
    ):
        self._loc = location
        self.policy = policy
        self._overrides = overrides
        self._book = book
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future | None = None

    # -- the deletion thread

    def start(self) -> None:
        """The writer's open: the deletion thread (a reader never deletes)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fop-retention")

    def submit(self, just_written: int) -> None:
        """After a commit (background thread): retention runs on the deletion thread."""
        if self._pool is not None:
            self._future = self._pool.submit(self.apply, just_written)

    def wait(self) -> None:
        """Waits for the last submitted run."""
        fut = self._future
        if fut is not None:
            fut.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- metrics

    def metric_of(self, extras: Any) -> float | None:
        """The metric of ``keep_best`` in the extras being saved, if any."""
        if self.policy.best_metric is None or not isinstance(extras, Mapping):
            return None
        return as_metric(extras.get(self.policy.best_metric))

    def metric(self, step: int) -> float | None:
        """``step``'s metric: known from its save, else read from its extras once."""
        known, value = self._book.metric(step)
        if known:
            return value
        name = self.policy.best_metric
        try:
            step_loc = _steps.step_location(self._loc, step)
            entry = _steps.read_manifest(step_loc).items.get("extras")
            if entry is not None:
                extras = checkpointable_for("extras", self._overrides).restore(
                    step_loc.child(entry.dir), None
                )
                if isinstance(extras, Mapping):
                    value = as_metric(extras.get(name))
        except CheckpointError as e:
            logger.warning("retention: cannot read metric of step %d: %s", step, e)
        self._book.set_metric(step, value)
        return value

    # -- deleting

    def apply(self, just_written: int | None) -> list[int]:
        """Deletion thread: delete the steps the retention policy does not keep (the
        primary); the other processes drop the same steps from their list in memory."""
        removed: list[int] = []
        try:
            if not self.policy.deletes_anything:
                return removed
            doomed = self._doomed(just_written)
            if not (_distributed.is_primary() or self._book.per_host):  # the primary deletes
                for s in doomed:
                    self._book.removed(s)
                return removed
            for s in doomed:
                if not self._book.begin_delete(s):
                    continue
                try:
                    _ownership.remove_step(self._loc, s)
                    removed.append(s)
                    self._book.removed(s)
                finally:
                    self._book.end_delete(s)
        except Exception:
            logger.exception("retention failed in %s", self._loc)
        self._book.events.steps_removed(just_written, str(self._loc), removed)  # StepsRemoved
        return removed

    def _doomed(self, just_written: int | None) -> list[int]:
        steps = self._book.known()
        metrics = {}
        if self.policy.keep_best is not None:
            metrics = {s: self.metric(s) for s in steps}
            metrics = {s: m for s, m in metrics.items() if m is not None}
        # The newest step is kept as well as the one this pass was run for: a pass that
        # runs late (its step's commit, then the next step's, then this pass) must not
        # delete the step a resume would read.
        newest = {max(steps)} if steps else set()
        protected = ({just_written} - {None}) | newest | self._book.being_read()
        tier = self._book.tier
        if tier is not None:  # not yet replicated: kept locally
            protected |= tier.pending_steps()
            if self._book.per_host:  # each host's copy: no due step newer than the bucket
                newest = max(tier.known_steps(), default=-1)
                protected |= {s for s in steps if s > newest and tier.due(s)}
        return steps_to_delete(steps, self.policy, metrics=metrics, protected=protected)
