"""The persistent tier: its option object :class:`Tier` (a frozen value, any thread; each
field declared once in :data:`FIELDS`), and :class:`PersistentTier`, the façade the
manager calls over its collaborators (one :class:`~.state.TierState`), whose collective
open has every process open alike or raise. Who calls what, from which thread, and the
rules on ownership and damage: ``docs/tiers.md``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any

from ..._base import distributed as _distributed
from ..._base.env import Option, check, found
from ..._base.keywords import refuse_without
from ..._core import removing as _removing
from ..._core.handle import checked_timeout
from ..._errors import CheckpointError, DirectoryLockedError, OptionError, ReplicationError
from ..._format import steps as _steps
from ..._format.foreign import foreign_run
from ..._storage import lease as _lease
from ..._storage.location import Location, spec_from_path
from ..events import Events
from ..retention import KEEP, KEEP_EVERY, Retention
from .copy_down import CopyDown, DamagedSteps
from .replicator import Replicator, Rounds
from .state import Places, TierState

logger = logging.getLogger("flax_orbax_plugin")


def _check_places(local: Location, remote: Location) -> None:
    """The two tiers are two places side by side (not one inside the other)."""
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
    """The persistent copy of a manager's local directory ``local`` (see
    ``docs/tiers.md``), as the checked ``tier`` (a ``Tier``) says.

    Args:
      remove_step: ``remove_step(location, step)`` deletes a committed step (the
        manager's, so both tiers delete alike).
      busy: True while the manager's own save is in flight; the copy waits meanwhile
        (at most :data:`~.state.MAX_DEFER_S` per step).
      per_host: each process has its own local directory.
      host_memory: the manager's host-memory ceiling, which bounds each copy.
      events: the manager's, told of each replicated step and removal.
    """

    def __init__(
        self,
        local: Location,
        tier: Any,
        *,
        remove_step: Callable[[Location, int], None],
        busy: Callable[[], bool] = lambda: False,
        per_host: bool = False,
        host_memory: int | str | None = None,
        events: Events | None = None,
    ):
        self.local = local
        self.remote = remote = Location.from_path(tier.path)
        _check_places(local, remote)
        primary = _distributed.is_primary()
        multi = _distributed.process_count() > 1  # each process copies its share
        self.retention = retention = Retention(keep=tier.keep, keep_every=tier.keep_every)
        self.grace_seconds = float(tier.grace_seconds)
        self._lease_seconds = tier.lease_seconds  # checked, a float: Tier's declaration
        where = (local, remote, retention.rule, remove_step, primary, multi, per_host, tier.every)
        self._places = Places(*where, host_memory, tier.keep_every)
        self._state = TierState(events=Events() if events is None else events, busy=busy)
        self._damaged = DamagedSteps(self.remote)
        self._rounds = Rounds(self._places, self._state)
        self._replicator = Replicator(self._places, self._state, self._rounds, self._damaged)
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

    def open(self, local_steps: Iterable[int], *, region: _distributed.Region) -> None:
        """Cleans the persistent tier's unfinished copies, queues the local steps it lacks
        and starts the replicator thread. Collective, in the manager open's ``region``:
        the primary lists, decides what is missing and shares both."""
        remote_steps: list[int] = []
        missing: list[int] = []
        failure: BaseException | None = None
        if self._places.primary:
            remote_steps, missing, failure = _open_primary(
                self._places, self._state, self._damaged, local_steps, self._lease_seconds
            )
        if self._places.multi:
            remote_steps, missing = _share_open(
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
        """Queues a step just committed locally, on every process (the primary's is copied)."""
        state = self._state
        with state.cond:
            if not (self._places.due(step) or step in state.forced):  # Tier(every=), force()
                return
            if not self._places.primary and self._already_decided(step):
                return
            state.enqueue(step, self._places.kept_forever)
            state.cond.notify_all()

    def due(self, step: int) -> bool:
        """Whether ``step`` goes to this tier (``Tier(every=)``, or :meth:`force`)."""
        with self._state.cond:
            return self._places.due(step) or step in self._state.forced

    def force(self, step: int) -> None:
        """``step`` (saved on SIGTERM) goes to this tier whatever ``Tier(every=)`` says."""
        with self._state.cond:
            self._state.forced.add(step)

    def _already_decided(self, step: int) -> bool:
        """Under ``cond``, not on the primary: a round for ``step`` or a newer one began."""
        rounds = self._state.round_steps
        newest = max(rounds, default=-1)
        return step in rounds or (step < newest and not self._places.kept_forever(step))

    def pending_steps(self) -> set[int]:
        """Local steps queued or being copied: local retention keeps them."""
        with self._state.cond:
            return set(self._state.pending())

    def known_steps(self) -> set[int]:
        """Steps committed in the persistent tier as of open, plus those replicated since."""
        with self._state.cond:
            return set(self._state.known)

    def steps(self) -> list[int]:
        """Steps committed in the persistent tier now (listed), less those proven damaged."""
        return self._damaged.committed_steps()

    def mark_copies(self, marker: Callable[[int], bytes]) -> None:
        """Each host's own directory: a step copied down gets ``marker(step)``."""
        self._state.marker = marker

    @property
    def run_id(self) -> str | None:
        """The run owning both places (the primary's; None elsewhere, or before open)."""
        owner = self._state.owner
        return None if owner is None else owner.run_id

    def agreed_steps(self, region: _distributed.Region | None = None) -> list[int] | None:
        """Collective (in ``region``): the primary's :meth:`steps`; None (logged) if unlisted."""
        steps = None
        if self._places.primary:
            try:
                steps = self.steps()
            except Exception as e:  # noqa: BLE001  (an unreachable store: the local tier)
                logger.warning("checkpoint: cannot list %s: %s", self.remote, e)
        if self._places.multi:
            region = region or _distributed.Region("tiers-steps")
            op = region.next_operation_id("tiers-steps")
            steps = json.loads(region.broadcast_str(op, json.dumps(steps)))
        return steps

    def remove(self, step: int) -> None:
        """Deletes a committed step of the persistent tier (the primary)."""
        with self._state.cond:
            self._state.known.discard(step)
        if self._places.primary:
            self._places.remove_step(self.remote, step)

    def ensure_local(self, step: int, region: _distributed.Region) -> bool:
        """Training thread, collective: :meth:`CopyDown.ensure_local`."""
        return self._copy_down.ensure_local(step, region)

    @property
    def error(self) -> ReplicationError | None:
        return self._state.error

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or being copied, or ``timeout`` seconds (None: no
        limit) passed; returns whether everything was replicated. Raises the error of a
        failed copy (once). From the manager's on_event hook: HookReentryError."""
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
        self._state.raise_error()
        return idle

    def close(self, timeout: float | None = None, *, raise_errors: bool = True) -> None:
        """Waits up to ``timeout`` for the queue to drain, then stops the replicator (a
        copy still running is abandoned uncommitted). Idempotent. Several processes:
        every process calls it; the others follow the primary's rounds until it
        announces their end. ``raise_errors``: False logs a failed copy instead."""
        timeout = checked_timeout(timeout)
        self._state.events.refuse_in_hook("persistent.close()")
        state = self._state
        if state.stop and (self._thread is None or not self._thread.is_alive()):
            self._release_owner()
            return
        follower = self._places.multi and not self._places.primary
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            done = self.wait(timeout)
        except ReplicationError as e:
            if raise_errors:
                raise
            logger.error("checkpoint: %s", e)
            done = False
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
            self._state.raise_error()  # a last round's failure, seen while following
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


def _open_primary(
    places: Places,
    state: TierState,
    damaged: DamagedSteps,
    local_steps: Iterable[int],
    lease_seconds: float,
) -> tuple[list[int], list[int], BaseException | None]:
    """Primary: takes both places for this run, reads the damage record, removes unfinished
    copies; returns the persistent steps, the local steps to queue and a failure to share."""
    remote_steps: list[int] = []
    failure: BaseException | None = None
    try:
        held = foreign_run(places.remote)  # its run record would land inside that run
        if held is not None:
            raise CheckpointError(
                f"persistent path {places.remote} holds {held}: a tier writes steps of its "
                f"own run there; convert them first (`flax-orbax import`), or give the "
                f"tier a path of its own"
            )
        state.owner = _lease.RunOwner(
            places.local,
            places.remote,
            lease_seconds=lease_seconds,
            steps_of=_steps.committed_steps,
        )
        state.owner.open()  # this run's place, or DirectoryLockedError/CheckpointError
        damaged.steps = damaged.read()
        _remove_unfinished(places.remote)
        remote_steps = damaged.committed_steps()
    except BaseException as e:
        if state.owner is not None:
            state.owner.close()
        if not places.multi:
            raise
        failure = e
    latest = remote_steps[-1] if remote_steps else -1
    missing = [
        s
        for s in local_steps
        if places.due(s) and s not in remote_steps and (s > latest or places.kept_forever(s))
    ]
    return remote_steps, missing, failure


def _share_open(
    damaged: DamagedSteps,
    rounds: Rounds,
    remote_steps: list[int],
    missing: list[int],
    failure: BaseException | None,
    region: _distributed.Region,
) -> tuple[list[int], list[int]]:
    """Every process (in ``region``): the primary's outcome of the open, or its error."""
    op = region.next_operation_id("tiers-open")
    mine = {
        "remote": remote_steps,
        "missing": missing,
        "damaged": {str(k): v for k, v in damaged.steps.items()},
        "rounds": secrets.token_hex(6),
        "error": None if failure is None else [type(failure).__name__, str(failure)],
    }
    shared = json.loads(region.broadcast_str(op, json.dumps(mine)))
    if shared["error"] is not None:  # every process raises the primary's error
        if failure is not None:
            raise failure
        kind, text = shared["error"]
        cls = DirectoryLockedError if kind == "DirectoryLockedError" else CheckpointError
        raise cls(f"opening the persistent tier failed on the primary: {text}")
    damaged.steps = {int(k): v for k, v in shared["damaged"].items()}
    rounds.prefix = f"fop/{shared['rounds']}/replicate"
    return shared["remote"], shared["missing"]


def _remove_unfinished(remote: Location) -> None:
    """Primary, at open: removes the copies that never committed, each once proven ours."""
    listing = _steps.list_directory(remote)
    for name in listing.unfinished:
        _removing.remove_if_ours(remote.child(name), what="unfinished copy")
    if not remote.is_local:
        for name in listing.foreign:
            if _steps.is_step_name(name):
                _removing.remove_if_ours(remote.child(name), what="uncommitted copy")


def check_place(name: str, value: Any) -> Any:
    """A path option ``name`` checked: its type here, what it names by ``spec_from_path``."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"expected a path or URL, found {found(value)}")
    if not isinstance(value, str | Location | dict) and not hasattr(value, "__fspath__"):
        raise TypeError(
            f"expected a path, an s3:// / gs:// URL or a kvstore dict, found {found(value)}"
        )
    if not isinstance(value, Location):
        spec_from_path(value, what=name)
    return value


PATH = Option("persistent", "custom", convert=functools.partial(check_place, "persistent"))
"""A tier's path, checked as the manager's ``persistent=`` (the name its errors give)."""

FIELDS: tuple[Option, ...] = (
    # the manager's own retention fields, without their aliases, documented for the tier
    replace(
        KEEP,
        aliases=(),
        doc="the tier's own retention: its last N steps (None: every replicated step)",
    ),
    replace(KEEP_EVERY, aliases=(), doc="also keep every step divisible by it there, forever"),
    Option(
        "every",
        "int",
        low=1,
        default=1,
        expected="a positive int",
        doc="replicate only the committed steps divisible by it (and the SIGTERM step)",
    ),
    Option(
        "grace_seconds",
        "number",
        low=0,
        high=threading.TIMEOUT_MAX,
        default=30.0,
        expected=f"a number of seconds >= 0 and <= {threading.TIMEOUT_MAX:g}",
        doc="after SIGTERM, how long the exit waits for its step to be replicated",
    ),
    Option(
        "lease_seconds",
        "number",
        low=_lease.MIN_LEASE_SECONDS,
        high=_lease.MAX_LEASE_SECONDS,
        default=_lease.LEASE_SECONDS,
        expected=(
            f"a number of seconds >= {_lease.MIN_LEASE_SECONDS:g} and <= "
            f"{_lease.MAX_LEASE_SECONDS:g}"
        ),
        doc="on an object store, the lease that makes one live run own the path",
    ),
)
"""The keyword fields of :class:`Tier` (its path is positional)."""


def refuse_idle(values: dict[str, Any], local: bool, name: Callable[[str], str] = str) -> None:
    """Refuses a tier's field that does nothing (``name(field)``: as it was given)."""
    if values["keep"] is None:
        refuse_without(
            name("keep_every"),
            values["keep_every"],
            f"{name('keep')}= (the tier keeps every step without it)",
        )
    if local:
        default = _lease.LEASE_SECONDS
        needs = "a persistent tier on an object store (a filesystem path is held by a lock)"
        refuse_without(name("lease_seconds"), values["lease_seconds"], needs, default=default)


@dataclass(frozen=True)
class Tier:
    """A persistent tier: ``path`` (``s3://``, ``gs://``, a shared filesystem path or a
    kvstore spec) and its keyword fields (``FIELDS``; see docs/tiers.md).

    Checked when made: OptionError naming the field, an UnsupportedLocationError for
    the path. Frozen; any thread.
    """

    path: Any
    _: KW_ONLY
    keep: int | None = None
    keep_every: int | None = None
    every: int = 1
    grace_seconds: float = 30.0
    lease_seconds: float = _lease.LEASE_SECONDS

    def __post_init__(self) -> None:
        PATH.check(self.path)
        values = check(FIELDS, {o.name: getattr(self, o.name) for o in FIELDS})
        for field_name, value in values.items():
            object.__setattr__(self, field_name, value)
        refuse_idle(values, Location.from_path(self.path).is_local)

    def open(
        self,
        local: Location,
        *,
        remove_step: Callable[[Location, int], None],
        busy: Callable[[], bool],
        per_host: bool,
        host_memory: int | str | None = None,
        events: Events | None = None,
    ) -> PersistentTier:
        """The ``PersistentTier`` this option describes, replicating ``local`` (the
        manager's writer open calls it; the other arguments: see PersistentTier)."""
        return PersistentTier(
            local,
            self,
            remove_step=remove_step,
            busy=busy,
            per_host=per_host,
            host_memory=host_memory,
            events=events,
        )
