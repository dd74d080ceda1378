"""PersistentTier: a manager's local directory of steps, replicated to a persistent one.

The façade the manager calls (open, submit, wait, close, steps, ensure_local) over its
collaborators: ``opening`` (the collective open), :class:`~.replicator.Replicator`
(the primary's replicator thread), :class:`~.rounds.Rounds` (the rounds of several
processes), :class:`~.copy_down.CopyDown` (restore's copy down) and
:class:`~.damaged.DamagedSteps`, sharing one :class:`~.state.TierState`. Who calls
what, from which thread, the multi-process protocol and the rules on ownership and
damage: ``docs/tiers.md``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..._base import distributed as _distributed
from ..._core.handle import checked_timeout
from ..._errors import OptionError, ReplicationError
from ..._storage import run_owner as _run_owner
from ..._storage.location import Location
from ..events import Events
from ..retention import Retention
from .copy_down import CopyDown
from .damaged import DamagedSteps
from .opening import open_primary, share_open
from .replicator import Replicator
from .rounds import Rounds
from .state import Places, TierState, Yielding

__all__ = ["PersistentTier"]

logger = logging.getLogger("flax_orbax_plugin")


def _check_places(local: Location, remote: Location) -> None:
    """The local tier is a local directory, and the two tiers are two places side by
    side (one place, or one inside the other: each would list the other's steps)."""
    if not local.is_local:
        raise ValueError(
            f"the local tier must be a local directory, found {local}; give the bucket "
            f"as persistent= and a local path as the manager's directory"
        )
    if remote.is_local:
        mine, theirs = (os.path.realpath(x.path) + os.sep for x in (local, remote))
        if mine.startswith(theirs) or theirs.startswith(mine):
            itself = mine == theirs
            where = "the local directory itself" if itself else "nested with the local directory"
            raise OptionError(
                f"persistent location {remote} is {where} ({local}): the two tiers "
                f"are two places side by side, e.g. /scratch/run and /shared/run"
            )


class PersistentTier:
    """The persistent copy of a manager's local directory; see ``docs/tiers.md``.

    Args:
      local: the manager's directory (a local filesystem).
      remote: the persistent location (any store).
      keep, keep_every: the persistent tier's retention (as the manager's ``keep`` and
        ``keep_every``): ``keep=None`` keeps every replicated step.
      grace_seconds: how long a close after SIGTERM waits for the replication.
      remove_step: ``remove_step(location, step)`` deletes a committed step (the
        manager's, so both tiers delete alike).
      busy: returns True while the manager's own save is in flight; the copy waits
        meanwhile (at most :data:`~.state.MAX_DEFER_S` per step): the local save comes
        first.
      lease_seconds: the lease on an object-store persistent path (see docs/run_owner.md).
      per_host: each process has its own local directory (see docs/tiers.md).
      every: only the steps divisible by it are replicated (the manager's
        ``Tier(every=)``), and those :meth:`force` names.
      host_memory: the manager's host-memory ceiling (bytes, "auto" or None): each
        copy up or down holds at most it (``files.copy_files``).
      events: the manager's, told of each replicated step and removal.
    """

    def __init__(
        self,
        local: Location,
        remote: Any,
        *,
        keep: int | None = None,
        keep_every: int | None = None,
        grace_seconds: float = 30.0,
        remove_step: Callable[[Location, int], None],
        busy: Callable[[], bool] = lambda: False,
        lease_seconds: float = _run_owner.LEASE_SECONDS,
        per_host: bool = False,
        every: int = 1,
        host_memory: int | str | None = None,
        events: Events | None = None,
    ):
        self.local = local
        self.remote = remote = Location.from_path(remote)
        _check_places(local, remote)
        # With several processes the local directory is one every host mounts (as for
        # any manager directory): each process copies its share of every step, the
        # primary decides the rounds and commits; see docs/tiers.md.
        primary = _distributed.is_primary()
        multi = _distributed.process_count() > 1
        if not grace_seconds >= 0:
            raise ValueError(f"persistent_grace_seconds must be >= 0, found {grace_seconds!r}")
        self.retention = retention = Retention(keep=keep, keep_every=keep_every)
        self.grace_seconds = float(grace_seconds)
        self._lease_seconds = lease_seconds  # checked by its declaration (Tier, tier_option)
        where = (local, remote, retention.rule, remove_step, primary, multi, per_host, every)
        self._places = Places(*where, host_memory, keep_every)
        self._state = TierState() if events is None else TierState(events=events)
        self._damaged = DamagedSteps(self.remote)
        yielding = Yielding(busy, self._state)
        self._rounds = Rounds(self._places, self._state, yielding)
        self._replicator = Replicator(
            self._places, self._state, yielding, self._rounds, self._damaged
        )
        self._copy_down = CopyDown(self._places, self._state, self._damaged)
        self._thread: threading.Thread | None = None

    @property
    def replicated(self) -> list[int]:
        """Steps committed by this tier's rounds, in order."""
        return self._state.replicated

    @property
    def copied_files(self) -> dict[int, list[str]]:
        """This process's share of each step it helped commit: relative paths."""
        return self._state.copied_files

    @property
    def copied_down(self) -> list[int]:
        """Steps this tier tried to copy down, in order."""
        return self._state.copied_down

    # ------------------------------------------------------------------ lifecycle

    def open(
        self,
        local_steps: Iterable[int],
        *,
        region: _distributed.Region | None,
    ) -> None:
        """Cleans the persistent tier's unfinished copies, queues the local steps it lacks
        (see ``docs/tiers.md``) and starts the replicator thread. Collective: every process
        calls it, in the manager open's ``region``; the primary lists, decides what is
        missing and shares both (one key-value round), with the name of this tier's
        replication rounds."""
        remote_steps: list[int] = []
        missing: list[int] = []
        failure: BaseException | None = None
        if self._places.primary:
            remote_steps, missing, failure = open_primary(
                self._places, self._state, self._damaged, local_steps, self._lease_seconds
            )
        if self._places.multi:
            remote_steps, missing = share_open(
                self._damaged, self._rounds, remote_steps, missing, failure, region
            )
        state = self._state
        with state.cond:
            state.known = set(remote_steps)
            for s in missing:
                state.enqueue(s, self._places.kept_forever)
        if missing and self._places.primary:
            logger.info("checkpoint: replicating local steps %s to %s", missing, self.remote)
        self._rounds.start_region()
        if self._places.primary:
            target = functools.partial(self._rounds.in_region, self._replicator.run)
        else:
            target = self._rounds.follow
        self._thread = threading.Thread(target=target, name="fop-replicate", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Queues a step just committed locally (called after each local commit, on
        every process). With several processes the primary's queue decides what is
        copied; the others' queues only tell their :meth:`wait` what to wait for."""
        state = self._state
        with state.cond:
            if not self._due(step):  # Tier(every=): this step stays local
                return
            if not self._places.primary and self._already_decided(step):
                return
            state.enqueue(step, self._places.kept_forever)
            state.cond.notify_all()

    def due(self, step: int) -> bool:
        """Whether ``step`` goes to this tier (``Tier(every=)``, or :meth:`force`)."""
        with self._state.cond:
            return self._due(step)

    def _due(self, step: int) -> bool:
        return self._places.due(step) or step in self._state.forced

    def force(self, step: int) -> None:
        """``step`` goes to this tier whatever ``Tier(every=)`` says (the step saved
        on SIGTERM); called before its save starts, alike on every process."""
        with self._state.cond:
            self._state.forced.add(step)

    def _already_decided(self, step: int) -> bool:
        """Under ``cond``, not on the primary: the primary already started a round for
        ``step`` or for a newer step that supersedes it (a late submit)."""
        rounds = self._state.round_steps
        newest = max(rounds, default=-1)
        return step in rounds or (step < newest and not self._places.kept_forever(step))

    def pending_steps(self) -> set[int]:
        """Local steps queued or being copied: local retention keeps them."""
        with self._state.cond:
            return set(self._state.pending())

    def known_steps(self) -> set[int]:
        """Steps committed in the persistent tier as of open plus those replicated since
        (no listing of the store)."""
        with self._state.cond:
            return set(self._state.known)

    def steps(self) -> list[int]:
        """Steps committed in the persistent tier now (lists the store), less those a
        verified copy-down proved damaged (never listed again)."""
        return self._damaged.committed_steps()

    def mark_copies(self, marker: Callable[[int], bytes]) -> None:
        """Each host's own directory: a step copied down gets ``marker(step)`` as its
        host marker (committed with it), so the next restore reads it there (way a)."""
        self._state.marker = marker

    @property
    def run_id(self) -> str | None:
        """The run owning both places (the primary's; None elsewhere, or before open)."""
        owner = self._state.owner
        return None if owner is None else owner.run_id

    def agreed_steps(self, region: _distributed.Region | None = None) -> list[int] | None:
        """Collective (in ``region``, the manager restore's; None: a call of its own, on
        every process): the primary's :meth:`steps`, on every process; None (logged)
        when the store cannot be listed."""
        steps = None
        if self._places.primary:
            try:
                steps = self.steps()
            except Exception as e:  # noqa: BLE001  (an unreachable store: the local tier)
                logger.warning("checkpoint: cannot list %s: %s", self.remote, e)
        if self._places.multi:
            op = _distributed.next_operation_id("tiers-steps", region=region)
            steps = json.loads(_distributed.broadcast_str(op, json.dumps(steps), region=region))
        return steps

    def remove(self, step: int) -> None:
        """Deletes a committed step of the persistent tier (callback ``overwrite=True``);
        on the primary only, as the manager's retention."""
        with self._state.cond:
            self._state.known.discard(step)
        if self._places.primary:
            self._places.remove_step(self.remote, step)

    def ensure_local(self, step: int, region: _distributed.Region | None) -> bool:
        """Training thread, on restore: makes ``step`` a committed local step, copying it
        down when the local tier lacks it; collective, in the restore's ``region`` (see
        :meth:`CopyDown.ensure_local`)."""
        return self._copy_down.ensure_local(step, region)

    @property
    def error(self) -> ReplicationError | None:
        return self._state.error

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or being copied (or ``timeout`` passed);
        returns whether everything was replicated. Raises the error of a failed copy
        (once). On a process other than the primary it waits for the rounds of the
        steps it submitted (or newer ones that superseded them) to end.

        ``timeout``: seconds (a finite number >= 0, or None: no limit), checked first
        (OptionError). From the manager's on_event hook: HookReentryError (the copy
        it waits for delivers events too), never a hang."""
        timeout = checked_timeout(timeout)
        self._state.events.refuse_in_hook("persistent.wait()")
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self._state
        with state.cond:
            while state.queue or state.current is not None:
                if self._thread is None or not self._thread.is_alive():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                state.cond.wait(left)
            idle = not state.queue and state.current is None
        self._raise_error()
        return idle

    def close(self, timeout: float | None = None, *, raise_errors: bool = True) -> None:
        """Waits up to ``timeout`` for the queue to drain, then stops the replicator (a
        copy still running is abandoned uncommitted). Idempotent.

        Several processes: every process calls it (the manager's ``close`` does). The
        primary then announces the end of its rounds; the others follow the primary's
        rounds until that announcement, up to ``timeout`` (with None, up to the
        coordination timeout once the primary stops starting rounds). ``timeout`` and
        a call from the on_event hook: as :meth:`wait`."""
        timeout = checked_timeout(timeout)
        self._state.events.refuse_in_hook("persistent.close()")
        state = self._state
        if state.stop and (self._thread is None or not self._thread.is_alive()):
            self._release_owner()
            return
        follower = self._places.multi and not self._places.primary
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            done = self.wait(timeout) if raise_errors else self._wait_quietly(timeout)
        finally:
            with state.cond:
                if follower:
                    if state.closing_since is None:
                        state.closing_since = time.monotonic()
                else:
                    state.stop = True
                left = sorted(state.pending())
                state.cond.notify_all()
            if self._thread is not None and follower:  # until the primary's "stop"
                self._thread.join(None if deadline is None else deadline - time.monotonic())
            with state.cond:
                state.stop = True
                state.cond.notify_all()
            if self._thread is not None:
                self._thread.join(60)
            if self._thread is None or not self._thread.is_alive():
                self._release_owner()  # no copy runs any more: the place is free
        if follower and raise_errors:
            self._raise_error()  # a last round's failure, seen while following
        if not done and left:
            logger.warning(
                "checkpoint: steps %s not yet replicated to %s (within %s s); they will be "
                "replicated when a manager next opens %s",
                left,
                self.remote,
                timeout,
                self.local,
            )

    def _release_owner(self) -> None:
        if self._state.owner is not None:
            self._state.owner.close()  # idempotent

    def _wait_quietly(self, timeout: float | None) -> bool:
        try:
            return self.wait(timeout)
        except ReplicationError as e:
            logger.error("checkpoint: %s", e)
            return False

    def _raise_error(self) -> None:
        error = self._state.take_error()
        if error is not None:
            raise error
