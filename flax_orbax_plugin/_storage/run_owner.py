"""A run owns its places: the local directory and the persistent path of a tiered
manager each record the run that owns them (:mod:`.run_record`), and one live run holds
them at a time (a lock on filesystems, a lease on object stores). Both places must name
the same run. Only the primary process creates a :class:`RunOwner`.

Threading: :meth:`RunOwner.open` and :meth:`RunOwner.close` from the thread that owns
the tier (the training thread); :meth:`RunOwner.check` and
:meth:`RunOwner.raise_if_lost` from any thread; renewal runs on its own daemon
thread. The design: ``docs/run_owner.md``.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable

from .._errors import CheckpointError, DirectoryLockedError
from .lease import LEASE_SECONDS, Lease, settle
from .location import Location
from .lock import DirectoryLock
from .run_record import RUN_FILE, RunRecord, read_record, read_versioned

logger = logging.getLogger("flax_orbax_plugin")


class RunOwner:
    """The run owning a tiered manager's two places; primary process only.

    Args:
      local: the manager's directory (already locked by the manager).
      remote: the persistent path.
      lease_seconds: the lease on object stores (see ``docs/run_owner.md``).
      steps_of: a place's committed steps (a place without a record that holds steps
        was never this run's: every run writes both records when it opens).
    """

    def __init__(
        self,
        local: Location,
        remote: Location,
        *,
        lease_seconds: float = LEASE_SECONDS,
        steps_of: Callable[[Location], list[int]],
    ):
        self.local = local
        self.remote = remote
        self._steps_of = steps_of
        self.lease_seconds = lease_seconds  # checked by its declaration (tiers/tier_option)
        self.holder = secrets.token_hex(8)
        self.run_id: str | None = None
        self._lock: DirectoryLock | None = None  # the persistent path's, on filesystems
        self._lease: Lease | None = None  # the persistent path's, on object stores

    # ------------------------------------------------------------------ open / close

    def open(self) -> str:
        """Takes the persistent path (lock or lease), checks that both places belong to
        one run, writes the records a place lacks; returns the run id. Raises
        DirectoryLockedError (another live run holds it) or CheckpointError (two runs);
        nothing is held after a raise."""
        try:
            return self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> str:
        local_rec = read_record(self.local)
        if self.remote.is_local:
            path = self.remote.path.rstrip("/")
            if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
                raise CheckpointError(
                    f"persistent path {path}: expected a directory, found "
                    f"{'a symbolic link' if os.path.islink(path) else 'a file'} (left alone)"
                )
            self.remote.makedirs()
            self._lock = DirectoryLock(self.remote.path.rstrip("/"))
            self._lock.acquire()  # DirectoryLockedError: another live writer
            remote_rec, generation = read_record(self.remote), None
        else:
            found = read_versioned(self.remote)
            remote_rec, generation = settle(self.remote, *found, what="the persistent path")
        if local_rec is not None and remote_rec is not None and local_rec.run != remote_rec.run:
            raise CheckpointError(
                f"{self.local} belongs to run {local_rec.run} but the persistent path "
                f"{self.remote} belongs to run {remote_rec.run} ({RUN_FILE}): two runs. Give "
                f"this run its own persistent path, or its own local directory (an empty one "
                f"continues the persistent path's run)"
            )
        self._refuse_steps_without_record(local_rec, remote_rec)
        if local_rec is not None:
            run = local_rec.run
        elif remote_rec is not None:
            run = remote_rec.run
            logger.info(
                "checkpoint: %s continues run %s of %s (it had no run record of its own)",
                self.local,
                run,
                self.remote,
            )
        else:
            run = secrets.token_hex(16)
        self.run_id = run
        if self.remote.is_local:
            mine = self._record()
            if remote_rec is None or remote_rec != mine:
                self.remote.write_bytes(RUN_FILE, mine.to_bytes())
        else:
            self._lease = Lease(self.remote, run, seconds=self.lease_seconds, holder=self.holder)
            self._lease.take(generation)
        if local_rec is None:
            self.local.makedirs()
            self.local.write_bytes(RUN_FILE, self._record().to_bytes())
        return run

    def _refuse_steps_without_record(
        self, local_rec: RunRecord | None, remote_rec: RunRecord | None
    ) -> None:
        """Refuses a place without a record that holds steps, beside one with a record:
        another run's steps (every run writes both records at its open)."""
        pairs = ((self.local, local_rec, self.remote, remote_rec),)
        pairs += ((self.remote, remote_rec, self.local, local_rec),)
        for bare, rec, other, other_rec in pairs:
            steps = [] if rec is not None or other_rec is None else self._steps_of(bare)
            if steps:
                raise CheckpointError(
                    f"{bare} holds steps {steps[-3:]} but no run record ({RUN_FILE}), while "
                    f"{other} belongs to run {other_rec.run}: its steps are another run's. "
                    f"Give this run its own persistent path, or its own local directory"
                )

    def _record(self) -> RunRecord:
        """This run's record of a place it holds by a lock (no lease)."""
        assert self.run_id is not None
        return RunRecord.here(self.run_id, self.holder)

    def close(self) -> None:
        """Stops renewing and releases the place (the lock; on object stores the
        lease is marked released, ``lease_expires: 0``, keeping the run id). Idempotent."""
        if self._lease is not None:
            self._lease.release()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ------------------------------------------------------------------ while open

    def renew(self) -> None:
        """Object stores: extends the lease from now (``Lease.renew``); raises
        DirectoryLockedError when another run took the place."""
        if self._lease is not None:
            self._lease.renew()

    def raise_if_lost(self) -> None:
        """Raises the DirectoryLockedError of a lost lease (no I/O)."""
        if self._lease is not None:
            self._lease.raise_if_lost()

    def check(self, what: str) -> None:
        """Reads the persistent record again before ``what``: it must name this run
        (and, on object stores, this holder). CheckpointError otherwise."""
        self.raise_if_lost()
        rec = read_record(self.remote)
        if rec is None or rec.run != self.run_id:
            found = "no run record" if rec is None else f"a record of {rec.describe()}"
            raise CheckpointError(
                f"refusing {what}: {self.remote} should belong to this run ({self.run_id}) "
                f"but holds {found} in {RUN_FILE}; another run wrote there"
            )
        if not self.remote.is_local and rec.holder != self.holder:
            raise DirectoryLockedError(
                f"refusing {what}: {self.remote} is now held by {rec.describe()}, not by this "
                f"manager (its lease ran out)"
            )
