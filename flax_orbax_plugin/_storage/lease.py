"""One live writer per place on an object store: a lease held in its run record.

``take`` and ``release`` from the writer's thread; renewal on its own daemon thread;
``renew``, ``raise_if_lost`` and ``take_again_if_lost`` from any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.lease``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from .._base import processes as _processes
from .._errors import CheckpointError, DirectoryLockedError
from .location import Location
from .run_record import RUN_FILE, RunRecord, read_versioned, write_if

logger = logging.getLogger("flax_orbax_plugin")

LEASE_SECONDS = 60.0
MIN_LEASE_SECONDS = 1.0  # renewed every third of it: one conditional write (and read) each
MAX_LEASE_SECONDS = 366 * 86400.0  # a lease is renewed every third of it: a year is plenty
MAX_WAIT_SECONDS = 2 * LEASE_SECONDS  # an open waits out another host's lease this long


def when(t: float) -> str:
    """A lease time in words (UTC, ISO 8601, seconds)."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def _live(rec: RunRecord | None, now: float) -> bool:
    """Whether ``rec`` holds a lease not run out, of a holder not known dead (one of this
    host whose process is gone: a restart after SIGKILL need not wait)."""
    return (
        rec is not None
        and rec.lease_expires is not None
        and rec.lease_expires > now
        and _processes.alive_here(rec.host, rec.pid) is not False
    )


def live_holder(loc: Location) -> str | None:
    """Who holds a live lease on the object-store place ``loc`` now, and until when, or
    None (also for a record that cannot be read). Reads only."""
    try:
        rec, _ = read_versioned(loc)
    except CheckpointError:
        return None
    if not _live(rec, time.time()):
        return None
    assert rec is not None and rec.lease_expires is not None
    return f"{rec.describe()}, its lease renewed until {when(rec.lease_expires)}"


def _refusal(loc: Location, rec: RunRecord, now: float, what: str) -> DirectoryLockedError:
    if rec.host == socket.gethostname() and rec.pid == os.getpid():
        return DirectoryLockedError(
            f"{what} {loc} is held by {rec.describe()}: this process; close() its "
            f"CheckpointManager first (one writer at a time)"
        )
    return DirectoryLockedError(
        f"{what} {loc} is held by {rec.describe()}, whose lease expires at "
        f"{when(rec.lease_expires)} ({rec.lease_expires - now:.0f} s from now): one "
        f"writer at a time. Wait for it to close, open it with read_only=True to read "
        f"while it writes, or write elsewhere"
    )


def settle(
    loc: Location, rec: RunRecord | None, generation: Any, *, what: str
) -> tuple[RunRecord | None, Any]:
    """Before taking ``loc`` (its record ``rec``, read at ``generation``; ``what``: the
    place in words): a live lease of this host is a DirectoryLockedError at once; one of
    another host ending within :data:`MAX_WAIT_SECONDS` is waited out (a job moved off a
    dead machine), re-read every second, and refused once renewed. A lease run out,
    released, or of a holder dead here is taken over with a WARNING. Returns the record
    and generation to write over."""
    said = False
    while _live(rec, now := time.time()):
        assert rec is not None and rec.lease_expires is not None
        left = rec.lease_expires - now
        if rec.host == socket.gethostname() or left > MAX_WAIT_SECONDS:
            raise _refusal(loc, rec, now, what)
        if not said:
            logger.warning(
                "checkpoint: %s is held by %s, whose lease ends in %.0f s; waiting for it "
                "(a holder that died no longer renews it; a live one does, and is refused)",
                loc,
                rec.describe(),
                left,
            )
            said = True
        time.sleep(min(1.0, left + 0.05))
        found, found_generation = read_versioned(loc)
        if _live(found, time.time()) and found is not None and found != rec:  # renewed: alive
            raise _refusal(loc, found, time.time(), what)
        rec, generation = found, found_generation
    if rec is not None and rec.lease_expires:
        logger.warning(
            "checkpoint: taking over %s from %s, whose lease %s at %s (it died or hung "
            "without closing)",
            loc,
            rec.describe(),
            "expired" if rec.lease_expires <= time.time() else "would expire (its process is gone)",
            when(rec.lease_expires),
        )
    return rec, generation


class Lease:
    """A lease on ``loc`` for run ``run`` by ``holder``, taken by :meth:`take`; renewed
    on a daemon thread until :meth:`release`."""

    def __init__(
        self,
        loc: Location,
        run: str,
        *,
        seconds: float = LEASE_SECONDS,
        holder: str | None = None,
    ):
        self.loc, self.run, self.seconds = loc, run, seconds
        self.holder = secrets.token_hex(8) if holder is None else holder
        self._generation: Any = None  # of the record we last wrote
        self._guard = threading.Lock()  # guards _generation and _lost
        self._lost: DirectoryLockedError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self, *, expires: float | None = None) -> RunRecord:
        """This holder's record, its lease ending ``expires`` (default: a lease from now)."""
        expires = time.time() + self.seconds if expires is None else expires
        return RunRecord.here(self.run, self.holder, expires)

    def take(self, generation: Any) -> None:
        """Writes this holder's record if ``loc``'s is still at ``generation`` (read and
        checked with :func:`settle`), then renews it; DirectoryLockedError naming the
        one who wrote in between."""
        new = write_if(self.loc, self.record(), generation)
        if new is None:
            theirs, _ = read_versioned(self.loc)
            if theirs is None:  # S3 reads a missing bucket as a missing key: this raises
                self.loc.is_dir()
                raise CheckpointError(
                    f"{self.loc}: the store refused the conditional write of {RUN_FILE}, "
                    f"and holds no record"
                )
            raise DirectoryLockedError(
                f"{self.loc} was taken by {theirs.describe()} while this manager opened "
                f"it: one writer at a time"
            )
        self._generation = new
        self._thread = threading.Thread(target=self._renew_loop, name="fop-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stops renewing and marks the lease released (``lease_expires: 0``, the run id
        kept), unless it was lost. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
        self._thread = None
        with self._guard:
            generation, self._generation = self._generation, None
            lost = self._lost
        if generation is not None and lost is None:
            try:
                write_if(self.loc, self.record(expires=0.0), generation)
            except Exception as e:  # noqa: BLE001  (the lease then expires by itself)
                logger.warning("checkpoint: could not release the lease on %s: %s", self.loc, e)

    # A writer's open refused after the lease was taken: the record stays (it names the
    # run; a released lease is taken by the next open).
    discard = release

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self.renew()
            except DirectoryLockedError:
                return
            except Exception as e:  # noqa: BLE001  (a transient store error: next time)
                logger.warning("checkpoint: could not renew the lease on %s: %s", self.loc, e)

    def renew(self) -> None:
        """Extends the lease by :attr:`seconds` from now. Raises (and remembers)
        DirectoryLockedError when another writer took the place."""
        with self._guard:
            if self._lost is not None:
                raise self._lost
            generation = self._generation
            if generation is None:
                return
            new = write_if(self.loc, self.record(), generation)
            if new is not None:
                self._generation = new
                return
        theirs = None
        with contextlib.suppress(Exception):  # the error below says what is known
            theirs, _ = read_versioned(self.loc)
        lost = DirectoryLockedError(
            f"this run ({self.run}) lost {self.loc} to "
            + (theirs.describe() if theirs else "another writer")
            + f" (its lease of {self.seconds:.0f} s ran out before it was renewed); "
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

    # A writer's check right before it commits a step (any thread): renewed by a
    # conditional write, a writer that lost the place commits nothing over the new
    # holder's steps (DirectoryLockedError: the step is aborted).
    before_commit = renew

    def take_again_if_lost(self) -> bool:
        """The writer's check before each write (as ``DirectoryLock``'s): raises the
        DirectoryLockedError of a lost lease; False otherwise."""
        self.raise_if_lost()
        return False


def take(loc: Location, *, seconds: float = LEASE_SECONDS) -> Lease:
    """A plain writer's lease on the object-store directory ``loc`` (a manager's open),
    for the run its record names (a new one without a record). DirectoryLockedError
    while another writer's lease is live, or when another open won meanwhile."""
    rec, generation = settle(loc, *read_versioned(loc), what="the directory")
    lease = Lease(loc, secrets.token_hex(16) if rec is None else rec.run, seconds=seconds)
    lease.take(generation)
    return lease
