"""A run owns its places: the record of a place's run (``_RUN.json``: the run that owns
it, who holds it), the lease that makes one live writer of a place on an object store
(held in that record, written only if its generation is still current), and the run
owning a tiered manager's two places (:class:`RunOwner`).

``take`` and ``release`` from the writer's thread; renewal on its own daemon thread;
``renew``, ``raise_if_lost`` and ``take_again_if_lost`` from any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.lease``; the
run record and the run owner: ``docs/run_owner.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._base import processes as _processes
from .._errors import CheckpointError, CorruptCheckpointError, DirectoryLockedError
from . import local_files as _local_files
from .location import Location
from .lock import DirectoryLock

logger = logging.getLogger("flax_orbax_plugin")

RUN_FILE = "_RUN.json"
MAX_RECORD_BYTES = _local_files.RUN_RECORD.max_bytes
_LIBRARY = "flax_orbax_plugin"
_HEX = re.compile(r"^[0-9a-f]{8,64}$", re.ASCII)
_FIELDS = (  # a record's fields but its lease time: (name, its check, what it expects)
    ("library", lambda v: v == _LIBRARY, repr(_LIBRARY)),
    ("kind", lambda v: v == "run", "'run'"),
    ("run", lambda v: isinstance(v, str) and _HEX.match(v), "8 to 64 lowercase hex digits"),
    ("holder", lambda v: isinstance(v, str) and _HEX.match(v), "8 to 64 lowercase hex digits"),
    ("host", lambda v: isinstance(v, str) and len(v) <= 255, "a host name"),
    ("pid", lambda v: type(v) is int and 0 <= v < 1 << 32, "a process id"),
)


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """The owner record of one place (see ``docs/run_owner.md``)."""

    run: str
    host: str
    pid: int
    holder: str
    lease_expires: float | None = None

    @classmethod
    def here(cls, run: str, holder: str, expires: float | None = None) -> RunRecord:
        """The record of ``run`` held by ``holder`` in this process (a lease ending
        ``expires``; None: held by a lock)."""
        return cls(run, socket.gethostname(), os.getpid(), holder, expires)

    def to_bytes(self) -> bytes:
        """The record's JSON; ValueError for a lease time that could not be read back
        (past year 9999), StructureError for one over the reader's limits."""
        if self.lease_expires is not None:
            _local_files.check_time(self.lease_expires, RUN_FILE, "lease_expires", stored=False)
        doc = {"library": _LIBRARY, "kind": "run", **dataclasses.asdict(self)}
        return _local_files.encode(
            doc, RUN_FILE, _local_files.RUN_RECORD, sort_keys=True, separators=None
        )

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> RunRecord:
        """Parses and checks a record; CorruptCheckpointError naming the field."""
        doc = _local_files.parse(raw, where, _local_files.RUN_RECORD)
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(
                f"{where}: expected a JSON object, found {type(doc).__name__}"
            )
        for field, ok, expected in _FIELDS:
            if not ok(doc.get(field)):
                found = repr(doc.get(field))
                found = found if len(found) <= 80 else found[:77] + "..."
                raise CorruptCheckpointError(
                    f"{where}: field {field}: expected {expected}, found {found}"
                )
        host, pid, expires = doc["host"], doc["pid"], doc.get("lease_expires")
        if expires is not None:
            expires = _local_files.check_time(expires, where, "lease_expires", stored=True)
        return cls(doc["run"], host, pid, doc["holder"], expires)

    def describe(self) -> str:
        return f"run {self.run} (pid {self.pid} on {self.host})"


def read_record(loc: Location) -> RunRecord | None:
    """The record of ``loc``, or None. Never follows a link (ForeignEntryError); a
    malformed record is a CorruptCheckpointError naming the file and field."""
    raw = loc.read_bytes(RUN_FILE, max_bytes=MAX_RECORD_BYTES)
    return None if raw is None else RunRecord.from_bytes(raw, f"{loc}/{RUN_FILE}")


def read_versioned(loc: Location) -> tuple[RunRecord | None, Any]:
    """Object stores: the record and the storage generation it was read at."""
    raw, generation = loc.read_versioned(RUN_FILE, max_bytes=MAX_RECORD_BYTES)
    record = None if raw is None else RunRecord.from_bytes(raw, f"{loc}/{RUN_FILE}")
    return record, generation


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

    def _write(self, generation: Any, *, expires: float | None = None) -> Any | None:
        """This holder's record (its lease ending ``expires``, default: a lease from now)
        written only if the stored generation is still ``generation``: the new
        generation, or None when someone wrote meanwhile."""
        expires = time.time() + self.seconds if expires is None else expires
        record = RunRecord.here(self.run, self.holder, expires)
        return self.loc.write_if(RUN_FILE, record.to_bytes(), generation)

    def take(self, generation: Any) -> None:
        """Writes this holder's record if ``loc``'s is still at ``generation`` (read and
        checked with :func:`settle`), then renews it; DirectoryLockedError naming the
        one who wrote in between."""
        new = self._write(generation)
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
                self._write(generation, expires=0.0)
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
            new = self._write(generation)
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


# -- the run that owns a tiered manager's two places (the lock or lease of its
# persistent path, and the run record of both)


class RunOwner:
    """The run owning a tiered manager's two places (its local directory and persistent
    path each record the run that owns them, and both must name the same run); only the
    primary process creates one. :meth:`open` and :meth:`close` from the thread that owns
    the tier (the training thread); :meth:`check` and :meth:`raise_if_lost` from any
    thread; renewal runs on its own daemon thread.

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
