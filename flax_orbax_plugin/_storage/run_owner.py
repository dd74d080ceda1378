"""A run owns its places: the local directory and the persistent path of a tiered
manager each record the run that owns them (:mod:`.run_record`), and one live run
holds them at a time: a lock on filesystems, a lease renewed every third of
:data:`LEASE_SECONDS` on object stores (conditional writes, so two opens cannot both
win). Both places must name the same run. Only the primary process creates a
:class:`RunOwner`.

Threading: :meth:`RunOwner.open` and :meth:`RunOwner.close` from the thread that owns
the tier (the training thread); :meth:`RunOwner.check` and
:meth:`RunOwner.raise_if_lost` from any thread; renewal runs on its own daemon
thread. The design: ``docs/run_owner.md``.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._errors import CheckpointError, DirectoryLockedError
from .location import Location
from .lock import DirectoryLock
from .run_record import RUN_FILE, RunRecord, read_record, read_versioned, write_if

__all__ = ["LEASE_SECONDS", "RunOwner", "check_lease"]

logger = logging.getLogger("flax_orbax_plugin")

LEASE_SECONDS = 60.0
MIN_LEASE_SECONDS = 1.0  # renewed every third of it: one conditional write (and read) each
MAX_LEASE_SECONDS = 366 * 86400.0  # a lease is renewed every third of it: a year is plenty


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def check_lease(lease_seconds: Any) -> float:
    """``persistent_lease_seconds`` as a float; ValueError naming it otherwise (the
    time a record states must stay one a reader can format: at most a year)."""
    ok = isinstance(lease_seconds, (int, float)) and not isinstance(lease_seconds, bool)
    if not (ok and MIN_LEASE_SECONDS <= lease_seconds <= MAX_LEASE_SECONDS):
        raise ValueError(
            f"persistent_lease_seconds must be a number of seconds from {MIN_LEASE_SECONDS:g} "
            f"up to {MAX_LEASE_SECONDS:.0f} (a year), found {lease_seconds!r}"
        )
    return float(lease_seconds)


def _dead_here(rec: RunRecord) -> bool:
    """True when the record's holder ran on this host and its process is gone (a
    restart after SIGKILL need not wait for the lease to run out)."""
    if rec.host != socket.gethostname() or rec.pid == os.getpid():
        return False
    try:
        os.kill(rec.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class RunOwner:
    """The run owning a tiered manager's two places; primary process only.

    Args:
      local: the manager's directory (already locked by the manager).
      remote: the persistent path.
      lease_seconds: the lease on object stores (see ``docs/run_owner.md``).
      steps_of: a place's committed steps (a place without a record that holds steps
        was never this run's: every run writes both records when it opens).
      clock: wall-clock time source (``time.time``).
    """

    def __init__(
        self,
        local: Location,
        remote: Location,
        *,
        lease_seconds: float = LEASE_SECONDS,
        steps_of: Callable[[Location], list[int]],
        clock=time.time,
    ):
        self.local = local
        self.remote = remote
        self._steps_of = steps_of
        self.lease_seconds = check_lease(lease_seconds)
        self._clock = clock
        self.holder = secrets.token_hex(8)
        self.run_id: str | None = None
        self._lock: DirectoryLock | None = None  # the persistent path's, on filesystems
        self._generation: Any = None  # object stores: of the record we last wrote
        self._guard = threading.Lock()  # guards _generation and _lost
        self._lost: DirectoryLockedError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ open / close

    def open(self) -> str:
        """Takes the persistent path for this run (lock or lease), checks that both
        places belong to one run, writes the records a place lacks; returns the run id.
        Raises DirectoryLockedError (another live run holds the path) or CheckpointError
        (the places belong to different runs); nothing is held after a raise."""
        try:
            return self._open()
        except BaseException:
            self._release()
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
            remote_rec, generation = read_versioned(self.remote)
            self._refuse_live_lease(remote_rec)
        if local_rec is not None and remote_rec is not None and local_rec.run != remote_rec.run:
            raise CheckpointError(
                f"{self.local} belongs to run {local_rec.run} but the persistent path "
                f"{self.remote} belongs to run {remote_rec.run} (their {RUN_FILE} records "
                f"differ): they are two runs, and mixing them would replace or restore the "
                f"other's steps. Give this run its own persistent path, or its own local "
                f"directory (an empty one continues the persistent path's run)"
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
        mine = self._record(local=self.remote.is_local)
        if self.remote.is_local:
            if remote_rec is None or remote_rec != mine:
                self.remote.write_bytes(RUN_FILE, mine.to_bytes())
        else:
            new = write_if(self.remote, mine, generation)
            if new is None:  # another open wrote the record between our read and write
                theirs, _ = read_versioned(self.remote)
                if theirs is None:  # nobody's record: the store refused (S3 reads a
                    self.remote.is_dir()  # missing bucket as a missing key: this raises)
                    raise CheckpointError(
                        f"{self.remote}: the run record {RUN_FILE} could not be written "
                        f"(the store refused the conditional write, and holds no record)"
                    )
                raise DirectoryLockedError(
                    f"{self.remote} was taken by "
                    + (theirs.describe() if theirs else "another run")
                    + " while this manager opened it; one run writes to a persistent path "
                    "at a time"
                )
            self._generation = new
            self._thread = threading.Thread(target=self._renew_loop, name="fop-lease", daemon=True)
            self._thread.start()
        if local_rec is None:
            self.local.makedirs()
            self.local.write_bytes(RUN_FILE, self._record(local=True).to_bytes())
        return run

    def _refuse_steps_without_record(
        self, local_rec: RunRecord | None, remote_rec: RunRecord | None
    ) -> None:
        """A place without a record that holds steps, beside one with a record: another
        run's steps (every run writes both records at its open). Adopting it would copy
        them into this run, and a resume would restore the other run's weights."""
        pairs = ((self.local, local_rec, self.remote, remote_rec),)
        pairs += ((self.remote, remote_rec, self.local, local_rec),)
        for bare, rec, other, other_rec in pairs:
            steps = [] if rec is not None or other_rec is None else self._steps_of(bare)
            if steps:
                raise CheckpointError(
                    f"{bare} holds steps {steps[-3:]} but no run record ({RUN_FILE}), while "
                    f"{other} belongs to run {other_rec.run}: its steps are not that run's "
                    f"(every run records itself in both places when it opens), and mixing "
                    f"them would restore one run's weights into the other. Give this run "
                    f"its own persistent path, or its own local directory"
                )

    def _refuse_live_lease(self, rec: RunRecord | None) -> None:
        if rec is None or rec.lease_expires is None or rec.lease_expires == 0:
            return
        now = self._clock()
        if rec.lease_expires > now and not _dead_here(rec):
            raise DirectoryLockedError(
                f"{self.remote} is held by {rec.describe()}, whose lease expires at "
                f"{_when(rec.lease_expires)} ({rec.lease_expires - now:.0f} s from now): one "
                f"run writes to a persistent path at a time. Wait for it to close, or give "
                f"this run its own persistent path"
            )
        logger.warning(
            "checkpoint: taking over %s from %s, whose lease %s at %s (it died or hung "
            "without closing)",
            self.remote,
            rec.describe(),
            "expired" if rec.lease_expires <= now else "would expire (its process is gone)",
            _when(rec.lease_expires),
        )

    def _record(self, *, local: bool, expires: float | None = None) -> RunRecord:
        if not local and expires is None:
            expires = self._clock() + self.lease_seconds
        assert self.run_id is not None
        return RunRecord(
            self.run_id, socket.gethostname(), os.getpid(), self.holder, None if local else expires
        )

    def close(self) -> None:
        """Stops renewing and releases the place (the lock; on object stores the
        lease is marked released, ``lease_expires: 0``, keeping the run id). Idempotent."""
        self._release()

    def _release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
        self._thread = None
        with self._guard:
            generation, self._generation = self._generation, None
            lost = self._lost
        if generation is not None and lost is None:
            try:
                write_if(self.remote, self._record(local=False, expires=0.0), generation)
            except Exception as e:  # noqa: BLE001  (the lease then expires by itself)
                logger.warning("checkpoint: could not release the lease on %s: %s", self.remote, e)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # ------------------------------------------------------------------ while open

    def _renew_loop(self) -> None:
        interval = self.lease_seconds / 3
        while not self._stop.wait(interval):
            try:
                self.renew()
            except DirectoryLockedError:
                return
            except Exception as e:  # noqa: BLE001  (a transient store error: next time)
                logger.warning("checkpoint: could not renew the lease on %s: %s", self.remote, e)

    def renew(self) -> None:
        """Object stores: extends the lease by :attr:`lease_seconds` from now. Raises
        (and remembers) DirectoryLockedError when another run took the place."""
        with self._guard:
            if self._lost is not None:
                raise self._lost
            generation = self._generation
            if generation is None:
                return
            new = write_if(self.remote, self._record(local=False), generation)
            if new is not None:
                self._generation = new
                return
        theirs = None
        try:
            theirs, _ = read_versioned(self.remote)
        except Exception:  # noqa: BLE001  (the error below says what is known)
            pass
        lost = DirectoryLockedError(
            f"this run ({self.run_id}) lost {self.remote} to "
            + (theirs.describe() if theirs else "another writer")
            + f" (its lease of {self.lease_seconds:.0f} s ran out before it was renewed); "
            "nothing more is written there"
        )
        logger.error("checkpoint: %s", lost)
        with self._guard:
            self._lost, self._generation = lost, None
        raise lost

    def raise_if_lost(self) -> None:
        """Raises the DirectoryLockedError of a lost lease (no I/O)."""
        with self._guard:
            if self._lost is not None:
                raise self._lost

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
