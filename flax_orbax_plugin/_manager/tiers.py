"""Two tiers: a fast local directory of steps, replicated to a persistent one.

A :class:`CheckpointManager` given ``persistent=<url or path>`` writes and commits
every step to its own (local) directory exactly as without it; a
:class:`PersistentTier` then copies each committed step, every item included (the
data iterator's state too), to the persistent location (``s3://``, ``gs://``, a
shared filesystem) with that store's own commit (see ``_commit``):

* object stores: the step's files are written in place, the step manifest
  ``_CHECKPOINT.json`` last: it is the commit marker, so a step is listed there only
  once every file it names is there;
* filesystems: the files go to ``<step>.partial-<nonce>/``, are made durable, the
  manifest is written and the directory is renamed to ``<step>``.

The manifest is copied byte for byte (so the copy verifies like the original); the
sha256 of every JSON file it lists is checked while copying (a mismatch stops the
copy of that step and names the file, expected and found), and chunk data keeps the
crc32c that restore checks. Nothing is ever followed: the local step is walked with
``O_NOFOLLOW``/``lstat`` and a symlink or special file in it stops its copy.

Who calls what (one manager, one training thread, one replicator thread per process):

* the manager's constructor calls :meth:`PersistentTier.open` (after taking its lock
  and cleaning its own directory): the persistent tier's unfinished copies are
  removed, and the local steps newer than its latest step (or kept there forever by
  ``keep_every``) are queued: a restart finishes what a killed run left;
* the manager's background save thread calls :meth:`submit` after each local commit;
* the replicator thread copies the newest queued step first; an older queued step
  is dropped when a newer one is queued, unless the persistent retention keeps it
  forever (``keep_every``); then the persistent retention runs. It yields to the
  training loop: while the manager's own save is in flight it waits before each step
  and each file (at most :data:`MAX_DEFER_S` per step). A failed copy is
  retried twice, then logged and kept as the tier's :attr:`error` (raised by
  :meth:`wait` and by the manager's ``close``); the step is tried again at the next
  open;
* local retention never deletes a queued step or the one being copied
  (:meth:`pending_steps`);
* restore (training thread) calls :meth:`ensure_local` to copy a step down from the
  persistent tier into the local one (staged, verified in full, renamed) when the
  step is newer than every local one, or its local copy is damaged;
* ``close`` (and a SIGTERM-driven save) calls :meth:`close` with a deadline (the
  grace period after SIGTERM): what is still queued afterwards is logged and
  replicated at the next open.

Why restore copies down rather than reading the bucket directly: the manager's one
restore path (verification, set-aside of damaged steps, deleted-while-read checks)
stays the only one; the step lands on the fast tier where the next restart reads it;
and the copy verifies the manifest and every JSON checksum before anything is
allocated. The cost is local disk for one step, which the local tier has anyway.

Several processes. A manager's local directory is, with several processes, one that
every host mounts (the local commit renames a staging directory that all processes
wrote into), and so is the local tier here: every process sees every file of a step,
and **every process copies a share of it**, in rounds the primary decides. Every
process runs a replicator thread; the primary's ``submit`` queue (coalescing, yielding
to its saves, retries) chooses the step, and the processes meet through the
jax.distributed key-value store only (set and get, no barrier from these threads),
under a prefix the primary draws at :meth:`open` (``fop/<nonce>/replicate``):

1. the primary checks the step (manifest, listing; on an object store it un-commits
   an older copy) and sets round ``<n>`` to ``{step, staging nonce, manifest
   sha256}``; a round with nothing to copy (step gone, already there, a check failed)
   carries its outcome instead, and ``stop`` ends the rounds when its tier closes;
2. every process lists the local step, splits its files with the same deterministic
   :func:`_partition` (size-balanced, largest first), copies its share to the step's
   staging (in place on object stores; ``<step>.partial-<nonce>/`` on filesystems,
   the nonce from the round), makes it durable and sets ``<n>/status/<i>``: ok, a
   digest of the names and sizes it listed and what it copied, or its error;
3. the primary reads every status (each bounded by the coordination timeout) and
   commits (the manifest, last) only if all are ok, listed the same files and copied
   them all between them; otherwise it removes the uncommitted copy. It sets
   ``<n>/outcome``: ``committed``, ``skipped``, ``abandoned`` (a tier closed
   mid-copy), ``retry: ...`` (the next round copies the step again) or ``failed: ...``:
   the :class:`ReplicationError` naming the processes and their errors, which every
   process's :meth:`wait` and :meth:`close` then raise.

A lost process is not retried: its status never comes, the round fails after the
coordination timeout and what it wrote is removed; the step is replicated at the next
open. The other processes' :meth:`wait` waits for the rounds of the steps they
submitted; their :meth:`close` follows the rounds until the primary's ``stop``.
Persistent retention runs on the primary after a committed round. ``open``,
:meth:`agreed_steps` and :meth:`ensure_local` are collective: the primary lists or
copies down, then shares the result with one key-value round, so every process
restores the same step or raises the same error. With one process none of this runs:
the replicator copies the whole step and the key-value store is never used. Round
keys stay in the store for the job's lifetime (a few short strings per step, as the
commit's statuses).

Not supported: per-host local disks that other hosts cannot see (neither the manager's
local commit nor this tier handles them: each host would commit its own part locally,
and copy-down would fetch per host only the files its shards need).

One run per persistent path (``_run_owner``): at open the primary takes the path
for its run (a lock on filesystems, a renewed lease on object stores) and checks that
the local directory and the persistent path record the same run; a second live run is
refused with DirectoryLockedError, places of two runs with CheckpointError.

Touch nothing foreign (``_ownership``): unfinished copies are removed at open only once
proven ours (our pending marker); a step name held by anything of someone else's (a
user's ``2024/``, another library's step ``100/``) is never written into, replaced or
removed: its replication fails, naming it. Retention deletes only committed steps of
ours (``remove_step``).

Only proven damage sets a persistent step aside: a copy-down is verified in full before
its local commit; a step failing it is renamed ``<step>.corrupt-<nonce>`` (filesystems)
or recorded in :data:`DAMAGED_FILE` (object stores), never listed, copied down or
counted again, and its number is free for the next save, whose replication replaces
it. Environmental errors during a copy-down raise and set nothing aside.

A step replaced locally with ``overwrite=True`` is replaced on a filesystem tier
atomically (rename), on an object store by first un-committing the old copy (a window
where the step is absent there, never partial).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._base import distributed as _distributed
from .._base import faults as _faults
from .._core import ownership as _ownership
from .._core.commit import Staging
from .._core.verify import verify_step
from .._errors import (
    CheckpointError,
    CoordinationError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ForeignEntryError,
    ReplicationError,
)
from .._format import steps as _steps
from .._format.layout import MANIFEST_FILE, StepManifest
from .._storage import run_owner as _run_owner
from .._storage.location import Location
from .retention import RetentionPolicy, steps_to_delete

__all__ = ["PersistentTier", "ReplicationError"]

logger = logging.getLogger("flax_orbax_plugin")

COPY_THREADS = 16  # files copied at once (object stores are latency-bound)
RETRIES = 2
RETRY_DELAY_S = 0.5
# A copy yields to the training loop's own save: it waits while a local save is in
# flight (before each step and each file), but no longer than this per step, so a
# loop that saves all the time still gets its steps replicated.
MAX_DEFER_S = 10.0
POLL_S = 0.5  # other processes: how long one wait for the primary's next round lasts
# A file costs this much beyond its bytes when shares are balanced (object stores are
# latency-bound: a thousand small files are not free).
FILE_COST_BYTES = 1 << 16
# Object stores: the persistent steps a verified copy-down proved damaged (they cannot
# be renamed aside), with the sha256 of the manifest found damaged.
DAMAGED_FILE = "_DAMAGED.json"


class _Stopped(Exception):
    """The tier is closing: the copy in progress was abandoned (uncommitted)."""


class _RoundFailed(CheckpointError):
    """A round in which some process failed, or the processes saw different files."""


@dataclasses.dataclass
class _Round:
    """One replication round (several processes): its key-value name and step, and
    whether the primary has announced it yet."""

    key: str
    step: int
    announced: bool = False


class PersistentTier:
    """The persistent copy of a manager's local directory; see the module docstring.

    Args:
      local: the manager's directory (a local filesystem).
      remote: the persistent location (any store).
      keep, keep_every: the persistent tier's retention (as the manager's ``keep`` and
        ``keep_every``): ``keep=None`` keeps every replicated step.
      grace_seconds: how long a close after SIGTERM waits for the replication.
      remove_step: ``remove_step(location, step)`` deletes a committed step (the
        manager's, so both tiers delete alike).
      busy: returns True while the manager's own save is in flight; the copy waits
        meanwhile (at most :data:`MAX_DEFER_S` per step): the local save comes first.
      lease_seconds: the lease on an object-store persistent path (see ``_run_owner``).
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
    ):
        self.local = local
        self.remote = Location.from_path(remote)
        if not local.is_local:
            raise ValueError(
                f"the local tier must be a local directory, found {local}; give the bucket "
                f"as persistent= and a local path as the manager's directory"
            )
        if self.remote == local or (
            self.remote.is_local
            and os.path.realpath(self.remote.path) == os.path.realpath(local.path)
        ):
            raise ValueError(f"persistent location {self.remote} is the local directory itself")
        # With several processes the local directory is one every host mounts (as for
        # any manager directory): each process copies its share of every step, the
        # primary decides the rounds and commits; see the module docstring.
        self._primary = _distributed.is_primary()
        self._multi = _distributed.process_count() > 1
        if not grace_seconds >= 0:
            raise ValueError(f"persistent_grace_seconds must be >= 0, found {grace_seconds!r}")
        self.retention = RetentionPolicy(keep_last=keep, keep_every=keep_every)
        self.grace_seconds = float(grace_seconds)
        self._remove_step = remove_step
        self._busy = busy
        self._lease_seconds = _run_owner.check_lease(lease_seconds)
        self._owner: _run_owner.RunOwner | None = None  # the primary's, from open()
        # Persistent steps a verified copy-down proved damaged: {step: what failed}. On
        # filesystems they are renamed aside; object stores keep them, recorded in
        # DAMAGED_FILE, and they are never listed, copied down or counted again.
        self._damaged: dict[int, str] = {}
        self.copied_down: list[int] = []  # steps this tier tried to copy down, in order
        self._defer_until = 0.0  # replicator: the deadline of the current step's yielding
        self._cond = threading.Condition()
        self._queue: set[int] = set()  # guarded by _cond, like the fields below
        self._current: int | None = None
        self._reading: set[int] = set()  # steps being copied down: not deleted remotely
        self._known: set[int] = set()  # committed remotely, as far as this tier knows
        self._stop = False
        self._closing_since: float | None = None  # other processes: close() was called
        self._error: ReplicationError | None = None
        self._thread: threading.Thread | None = None
        # Several processes: the key-value prefix of this tier's rounds (agreed at open),
        # the next round's number (replicator thread only) and, on the other processes,
        # the steps the primary has started rounds for (guarded by _cond).
        self._rounds_key = ""
        self._round = 0
        self._round_steps: set[int] = set()
        self.replicated: list[int] = []  # steps committed by this tier's rounds, in order
        # This process's share of each step it helped commit: relative paths (for tests).
        self.copied_files: dict[int, list[str]] = {}

    # ------------------------------------------------------------------ lifecycle

    def open(self, local_steps: Iterable[int]) -> None:
        """Cleans the persistent tier's unfinished copies, queues the local steps it lacks
        (see the module docstring) and starts the replicator thread. Collective: every
        process calls it; the primary lists, decides what is missing and shares both
        (one key-value round), with the name of this tier's replication rounds."""
        remote_steps: list[int] = []
        missing: list[int] = []
        failure: BaseException | None = None
        if self._primary:
            try:
                self._owner = _run_owner.RunOwner(
                    self.local, self.remote, lease_seconds=self._lease_seconds
                )
                self._owner.open()  # this run's place, or DirectoryLockedError/CheckpointError
                self._damaged = self._read_damaged()
                self._remove_unfinished()
                remote_steps = self.steps()
            except BaseException as e:
                if self._owner is not None:
                    self._owner.close()
                if not self._multi:
                    raise
                failure = e
            latest = remote_steps[-1] if remote_steps else -1
            every = self.retention.keep_every
            missing = [
                s
                for s in local_steps
                if s not in remote_steps and (s > latest or (every is not None and s % every == 0))
            ]
        if self._multi:
            op = _distributed.next_operation_id("tiers-open")
            mine = {
                "remote": remote_steps,
                "missing": missing,
                "damaged": {str(k): v for k, v in self._damaged.items()},
                "rounds": secrets.token_hex(6),
                "error": None if failure is None else [type(failure).__name__, str(failure)],
            }
            shared = json.loads(_distributed.broadcast_str(op, json.dumps(mine)))
            if shared["error"] is not None:  # every process raises the primary's error
                if failure is not None:
                    raise failure
                kind, text = shared["error"]
                cls = DirectoryLockedError if kind == "DirectoryLockedError" else CheckpointError
                raise cls(f"opening the persistent tier failed on the primary: {text}")
            remote_steps, missing = shared["remote"], shared["missing"]
            self._damaged = {int(k): v for k, v in shared["damaged"].items()}
            self._rounds_key = f"fop/{shared['rounds']}/replicate"
        with self._cond:
            self._known = set(remote_steps)
            for s in missing:
                self._enqueue(s)
        if missing and self._primary:
            logger.info("checkpoint: replicating local steps %s to %s", missing, self.remote)
        target = self._run if self._primary else self._follow
        self._thread = threading.Thread(target=target, name="fop-replicate", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Queues a step just committed locally (called after each local commit, on
        every process). With several processes the primary's queue decides what is
        copied; the others' queues only tell their :meth:`wait` what to wait for."""
        with self._cond:
            if not self._primary and self._already_decided(step):
                return
            self._enqueue(step)
            self._cond.notify_all()

    def pending_steps(self) -> set[int]:
        """Local steps queued or being copied: local retention keeps them."""
        with self._cond:
            return set(self._queue) | ({self._current} - {None})

    def known_steps(self) -> set[int]:
        """Steps committed in the persistent tier as of open plus those replicated since
        (no listing of the store)."""
        with self._cond:
            return set(self._known)

    def steps(self) -> list[int]:
        """Steps committed in the persistent tier now (lists the store), less those a
        verified copy-down proved damaged (never listed again)."""
        damaged = self._damaged
        return [s for s in _steps.committed_steps(self.remote) if s not in damaged]

    @property
    def run_id(self) -> str | None:
        """The run owning both places (the primary's; None elsewhere, or before open)."""
        return None if self._owner is None else self._owner.run_id

    def agreed_steps(self) -> list[int] | None:
        """Collective: the primary's :meth:`steps`, on every process; None (logged) when
        the store cannot be listed."""
        steps = None
        if self._primary:
            try:
                steps = self.steps()
            except Exception as e:  # noqa: BLE001  (an unreachable store: the local tier)
                logger.warning("checkpoint: cannot list %s: %s", self.remote, e)
        if self._multi:
            op = _distributed.next_operation_id("tiers-steps")
            steps = json.loads(_distributed.broadcast_str(op, json.dumps(steps)))
        return steps

    def remove(self, step: int) -> None:
        """Deletes a committed step of the persistent tier (callback ``overwrite=True``);
        on the primary only, as the manager's retention."""
        with self._cond:
            self._known.discard(step)
        if self._primary:
            self._remove_step(self.remote, step)

    @property
    def error(self) -> ReplicationError | None:
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until nothing is queued or being copied (or ``timeout`` passed);
        returns whether everything was replicated. Raises the error of a failed copy
        (once). On a process other than the primary it waits for the rounds of the
        steps it submitted (or newer ones that superseded them) to end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._current is not None:
                if self._thread is None or not self._thread.is_alive():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            idle = not self._queue and self._current is None
        self._raise_error()
        return idle

    def close(self, timeout: float | None = None, *, raise_errors: bool = True) -> None:
        """Waits up to ``timeout`` for the queue to drain, then stops the replicator (a
        copy still running is abandoned uncommitted). Idempotent.

        Several processes: every process calls it (the manager's ``close`` does). The
        primary then announces the end of its rounds; the others follow the primary's
        rounds until that announcement, up to ``timeout`` (with None, up to the
        coordination timeout once the primary stops starting rounds)."""
        if self._stop and (self._thread is None or not self._thread.is_alive()):
            self._release_owner()
            return
        follower = self._multi and not self._primary
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            done = self.wait(timeout) if raise_errors else self._wait_quietly(timeout)
        finally:
            with self._cond:
                if follower:
                    if self._closing_since is None:
                        self._closing_since = time.monotonic()
                else:
                    self._stop = True
                left = sorted(self._queue | ({self._current} - {None}))
                self._cond.notify_all()
            if self._thread is not None and follower:  # until the primary's "stop"
                self._thread.join(None if deadline is None else deadline - time.monotonic())
            with self._cond:
                self._stop = True
                self._cond.notify_all()
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
        if self._owner is not None:
            self._owner.close()  # idempotent

    def _wait_quietly(self, timeout: float | None) -> bool:
        try:
            return self.wait(timeout)
        except ReplicationError as e:
            logger.error("checkpoint: %s", e)
            return False

    def _raise_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ replicator

    def _enqueue(self, step: int) -> None:
        """Under ``_cond``: queue ``step``; drop older queued steps the persistent
        retention would not keep forever (a newer one supersedes them)."""
        self._queue = {s for s in self._queue if s > step or self._kept_forever(s)}
        self._queue.add(step)

    def _kept_forever(self, step: int) -> bool:
        every = self.retention.keep_every
        return every is not None and step % every == 0

    def _already_decided(self, step: int) -> bool:
        """Under ``_cond``, not on the primary: the primary already started a round for
        ``step`` or for a newer step that supersedes it (a late submit)."""
        newest = max(self._round_steps, default=-1)
        return step in self._round_steps or (step < newest and not self._kept_forever(step))

    def _run(self) -> None:
        """The primary's replicator thread (the only one with one process)."""
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stop:
                        self._cond.wait()
                self._defer_until = time.monotonic() + MAX_DEFER_S
                self._yield_to_saves()  # then take the newest step, maybe the one just saved
                with self._cond:
                    if self._stop:
                        return
                    step = max(self._queue)
                    self._queue.discard(step)
                    self._current = step
                try:
                    self._replicate_with_retries(step)
                finally:
                    with self._cond:
                        self._current = None
                        self._cond.notify_all()
        finally:
            if self._multi:  # the other processes' replicators follow until this
                try:
                    self._announce(_Round(self._next_round_key(), -1), "stop")
                except Exception as e:  # noqa: BLE001  (they give up after the timeout)
                    logger.warning("checkpoint: could not end the replication rounds: %s", e)

    def _replicate_with_retries(self, step: int) -> None:
        for attempt in range(RETRIES + 1):
            rnd = _Round(self._next_round_key(), step) if self._multi else None
            before = _steps.step_location(self.local, step).read_bytes(MANIFEST_FILE)
            try:
                committed = self._replicate(step, rnd)
                self._finish(rnd, "committed" if committed else "skipped")
                if committed:
                    self._apply_retention(step)
                return
            except _Stopped:
                self._finish(rnd, "abandoned")
                return
            except Exception as e:  # noqa: BLE001  (kept and raised by wait/close)
                if self._replaced_meanwhile(step, before):
                    # overwrite=True replaced the local step mid-copy: what was read is a
                    # mix of two versions, no damage; the new version was queued itself.
                    logger.info(
                        "checkpoint: step %d was replaced locally while being copied; the "
                        "new version is copied instead (%s)",
                        step,
                        e,
                    )
                    self._finish(rnd, "skipped")
                    return
                retry = attempt < RETRIES and not isinstance(
                    e, (CorruptCheckpointError, CoordinationError, DirectoryLockedError)
                )
                detail = str(e) if isinstance(e, _RoundFailed) else f"{type(e).__name__}: {e}"
                if retry:
                    logger.warning(
                        "checkpoint: replicating step %d failed, retrying: %s", step, detail
                    )
                    self._finish(rnd, f"retry: {detail}")
                    time.sleep(RETRY_DELAY_S * (attempt + 1))
                    continue
                error = ReplicationError(
                    f"step {step} of {self.local} was not replicated to {self.remote}: {detail}"
                )
                error.__cause__ = e
                logger.error("checkpoint: %s", error)
                with self._cond:
                    self._error = error
                self._finish(rnd, f"failed: {error}")
                return

    def _replaced_meanwhile(self, step: int, before: bytes | None) -> bool:
        """Whether the local step's manifest changed since ``before`` was read."""
        try:
            now = _steps.step_location(self.local, step).read_bytes(MANIFEST_FILE)
        except Exception:  # noqa: BLE001  (unknown: the error stands as it is)
            return False
        return before is not None and now != before

    def _replicate(self, step: int, rnd: _Round | None) -> bool:
        """Copies one committed local step; returns False when there was nothing to do.
        With several processes (``rnd``) every process copies its share in this round
        (:meth:`_copy_share`), and this one, the primary, commits when all succeeded."""
        src = _steps.step_location(self.local, step)
        raw = src.read_bytes(MANIFEST_FILE)
        if raw is None:  # deleted locally (retention, a wiped directory) meanwhile
            logger.info("checkpoint: step %d is gone from %s; not replicated", step, self.local)
            return False
        manifest = _parse_manifest(raw, src, step)
        final = _steps.step_location(self.remote, step)
        if final.read_bytes(MANIFEST_FILE) == raw:
            with self._cond:
                self._known.add(step)
            return False  # already there (a restart after the commit, or copied down)
        files = _local_files(src.path, step)
        _check_listed(manifest, files, str(src))
        if self._owner is not None:
            self._owner.renew()  # at each step too; raises if another run took the path
        # A foreign entry with the step's name is never written into nor replaced.
        found = _ownership.check_slot(
            final, what=f"step {step} of the persistent tier", replace=True
        )
        t0 = time.perf_counter()
        nonce = secrets.token_hex(6)
        if not final.supports_rename and found == "step manifest":
            self._remove_step(self.remote, step)  # an older copy of ours: uncommit, remove
        elif not final.supports_rename and found is not None:
            _ownership.remove(final, action="clear the remains of a dead copy at", step=step)
        staging = Staging.begin(final, nonce)
        try:
            if rnd is None:
                nbytes = self._copy_files(
                    lambda rel: _read_local_file(src.path, rel, step),
                    staging.location,
                    files,
                    manifest,
                    str(src),
                )
                self.copied_files[step] = files
            else:
                sha = hashlib.sha256(raw).hexdigest()
                self._announce(rnd, json.dumps({"step": step, "staging": nonce, "manifest": sha}))
                statuses = [self._copy_share(step, nonce, sha)]
                for p in range(1, _distributed.process_count()):
                    statuses.append(json.loads(_distributed.get_from(f"{rnd.key}/status", p)))
                nbytes = _check_statuses(statuses, len(files))
            staging.location.sync()
            if self._owner is not None:
                self._owner.raise_if_lost()
            staging.publish(MANIFEST_FILE, raw, replace=True)  # the remote commit, last
        except BaseException:
            try:  # nothing partial stays: it would never be listed, but it takes space
                if staging.renames:
                    staging.abort()
                else:
                    _ownership.remove_if_ours(final, what="uncommitted copy")
            except Exception:  # noqa: BLE001
                pass
            raise
        self._forget_damaged(step)  # a good copy replaced a damaged one
        with self._cond:
            self._known.add(step)
        self.replicated.append(step)
        logger.info(
            "checkpoint: replicated step %d to %s: %d files, %d bytes, %.3f s",
            step,
            self.remote,
            len(files),
            nbytes,
            time.perf_counter() - t0,
        )
        return True

    # ------------------------------------------------------------------ several processes

    def _next_round_key(self) -> str:
        """Replicator thread: the key of this tier's next round (the same sequence on
        every process)."""
        key = f"{self._rounds_key}/{self._round}"
        self._round += 1
        return key

    def _announce(self, rnd: _Round, decision: str) -> None:
        """Primary: publishes a round's decision (a JSON object, or ``stop``)."""
        _distributed.broadcast_str(rnd.key, decision)
        rnd.announced = True

    def _finish(self, rnd: _Round | None, outcome: str) -> None:
        """Primary: publishes a round's outcome; a round that never got to copying is
        announced with its outcome in it (the others then copy nothing)."""
        if rnd is None:
            return
        try:
            if rnd.announced:
                _distributed.broadcast_str(f"{rnd.key}/outcome", outcome)
            else:
                self._announce(rnd, json.dumps({"step": rnd.step, "outcome": outcome}))
        except Exception as e:  # noqa: BLE001  (the others time out and say so)
            logger.warning("checkpoint: could not publish round %s: %s", rnd.key, e)

    def _copy_share(self, step: int, nonce: str, manifest_sha: str) -> dict[str, Any]:
        """Every process, in a round: lists the local step, takes its share of the files
        (:func:`_partition`, the same on every process) and copies it into the step's
        remote staging; returns this process's status (never raises but
        :class:`_Stopped` on the primary)."""
        listing = None
        try:
            src = _steps.step_location(self.local, step)
            raw = src.read_bytes(MANIFEST_FILE)
            if raw is None:
                raise CheckpointError(f"step {step}: {src}/{MANIFEST_FILE} vanished")
            if hashlib.sha256(raw).hexdigest() != manifest_sha:
                raise CheckpointError(
                    f"step {step}: {src}/{MANIFEST_FILE} differs from the one the primary read"
                )
            manifest = _parse_manifest(raw, src, step)
            sizes = _local_file_sizes(src.path, step)
            listing = _listing_digest(sizes)
            share = _partition(sizes, _distributed.process_count())[_distributed.process_index()]
            staging = Staging.begin(_steps.step_location(self.remote, step), nonce)
            nbytes = self._copy_files(
                lambda rel: _read_local_file(src.path, rel, step),
                staging.location,
                share,
                manifest,
                str(src),
            )
            staging.location.sync()  # this process's files: durable before it reports
        except _Stopped:
            if self._primary:
                raise
            return {"ok": False, "stopped": True, "listing": listing, "error": "closed"}
        except Exception as e:  # noqa: BLE001  (reported to the primary)
            return {"ok": False, "listing": listing, "error": f"{type(e).__name__}: {e}"}
        self.copied_files[step] = share
        return {"ok": True, "listing": listing, "bytes": nbytes, "files": len(share)}

    def _follow(self) -> None:
        """The replicator thread of a process other than the primary: takes part in the
        primary's rounds, in order, until it announces ``stop``."""
        try:
            while True:
                key = self._next_round_key()
                decision = self._await_round(key)
                if decision is None or decision == "stop":
                    return
                info = json.loads(decision)
                step = int(info["step"])
                with self._cond:
                    self._round_steps.add(step)
                    self._queue = {s for s in self._queue if s > step or self._kept_forever(s)}
                    self._queue.discard(step)
                    self._current = step
                try:
                    outcome = info.get("outcome")
                    if outcome is None:
                        self._defer_until = time.monotonic() + MAX_DEFER_S
                        status = self._copy_share(step, info["staging"], info["manifest"])
                        _distributed.publish(f"{key}/status", json.dumps(status))
                        # The primary may spend up to one timeout gathering statuses.
                        wait = 2 * _distributed.DEFAULT_TIMEOUT_S
                        outcome = _distributed.broadcast_str(f"{key}/outcome", None, timeout_s=wait)
                    self._settle(step, outcome)
                finally:
                    with self._cond:
                        self._current = None
                        self._cond.notify_all()
        except Exception as e:  # noqa: BLE001  (the primary is gone or late)
            error = ReplicationError(
                f"process {_distributed.process_index()} lost the primary's replication "
                f"rounds of {self.local} to {self.remote}: {type(e).__name__}: {e}"
            )
            error.__cause__ = e
            logger.error("checkpoint: %s", error)
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _await_round(self, key: str) -> str | None:
        """Follower: the primary's decision under ``key``; None when this tier stops (or
        its close found no round announced within the coordination timeout)."""
        start = time.monotonic()
        while True:
            with self._cond:
                if self._stop:
                    return None
                since = self._closing_since
            waited = None if since is None else time.monotonic() - max(since, start)
            if waited is not None and waited > _distributed.DEFAULT_TIMEOUT_S:
                logger.warning(
                    "checkpoint: the primary announced no replication round (%s) within %.0f s "
                    "of close; not following it further",
                    key,
                    _distributed.DEFAULT_TIMEOUT_S,
                )
                return None
            decision = _distributed.poll(key, wait_s=POLL_S)
            if decision is not None:
                return decision

    def _settle(self, step: int, outcome: str) -> None:
        """Follower: applies the outcome of the primary's round for ``step``."""
        with self._cond:
            if outcome == "committed":
                self._known.add(step)
                self.replicated.append(step)
            elif outcome.startswith("retry:"):
                self._queue.add(step)  # the primary runs another round of it
            elif outcome.startswith("failed:"):
                self._error = ReplicationError(outcome.split(": ", 1)[1])
            # skipped, abandoned: nothing committed, no error (the next open retries)
            if outcome != "committed":
                self.copied_files.pop(step, None)

    def _copy_files(
        self, read, dst: Location, files, manifest: StepManifest, src: str, restoring=False
    ) -> int:
        """Copies ``files`` (relative paths) into ``dst``, checking the sha256 of each
        JSON file the manifest lists; the manifest itself is not among them. A copy up
        (not ``restoring``) yields to local saves."""

        def one(rel: str) -> int:
            if not restoring:
                self._yield_to_saves()
                _faults.fail_point("replicate_file")
            else:
                _faults.fail_point("copy_down_file")
            if self._stop:
                raise _Stopped()
            data = read(rel)
            expected = manifest.files.get(rel)
            if expected is not None:
                found = hashlib.sha256(data).hexdigest()
                if found != expected:
                    raise CorruptCheckpointError(
                        f"{src}/{rel}: sha256 expected {expected} (the step manifest), "
                        f"found {found}; not copied"
                    )
            dst.write_bytes(rel, data, durable=False)
            return len(data)

        total = 0
        with ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="fop-copy") as pool:
            futures = [pool.submit(one, rel) for rel in files]
            try:
                for fut in futures:
                    total += fut.result()
                    _faults.kill_point("mid_replication")
            except BaseException:
                self._stop_pool(futures)
                raise
        return total

    def _yield_to_saves(self) -> None:
        """Replicator: waits while a local save is in flight, up to the step's deadline."""
        while not self._stop and time.monotonic() < self._defer_until and self._busy():
            time.sleep(0.005)

    @staticmethod
    def _stop_pool(futures) -> None:
        for f in futures:
            f.cancel()

    def _apply_retention(self, just_copied: int) -> None:
        if not self.retention.deletes_anything:
            return
        try:
            steps = self.steps()
        except Exception as e:  # noqa: BLE001  (the step is committed: retention waits)
            logger.warning("checkpoint: cannot list %s for retention: %s", self.remote, e)
            return
        with self._cond:
            protected = {just_copied} | self._reading
        # steps() leaves out the damaged ones: kept, as a step set aside, for inspection
        for s in steps_to_delete(steps, self.retention, protected=protected):
            with self._cond:
                if s in self._reading:
                    continue
                self._known.discard(s)
            try:
                self._remove_step(self.remote, s)
            except Exception as e:  # noqa: BLE001  (retention is retried after the next copy)
                logger.warning("checkpoint: could not delete step %d of %s: %s", s, self.remote, e)

    def _remove_unfinished(self) -> None:
        """Primary, at open: the persistent tier's copies that never committed
        (``.partial-``/``.deleting-`` directories on filesystems, step prefixes without a
        manifest on object stores), each removed only once proven ours (our pending
        marker in it, see ``_ownership``). Everything else is left alone: a user's
        ``2024/``, a ``007/``, another library's run."""
        listing = _steps.list_directory(self.remote)
        for name in listing.unfinished:
            _ownership.remove_if_ours(self.remote.child(name), what="unfinished copy")
        if not self.remote.is_local:
            for name in listing.foreign:
                if _steps.is_step_name(name):
                    _ownership.remove_if_ours(self.remote.child(name), what="uncommitted copy")

    # ------------------------------------------------------------------ copy down

    def ensure_local(self, step: int) -> bool:
        """Training thread, on restore: makes ``step`` a committed local step, copying it
        down from the persistent tier when the local tier lacks it. Returns False when
        neither tier has it. Raises CorruptCheckpointError (naming the file) when the
        persistent copy fails its checks; nothing is then left in the local tier.

        Collective with several processes: the primary copies, then tells the others
        the outcome (one key-value round), so all restore the same step or all raise."""
        if not self._multi:
            return self._ensure_local(step)
        outcome = "absent"
        if self._primary:
            try:
                outcome = "present" if self._ensure_local(step) else "absent"
            except Exception as e:  # noqa: BLE001  (every process raises it below)
                kind = "corrupt" if isinstance(e, CorruptCheckpointError) else "failed"
                outcome = f"{kind}: {type(e).__name__}: {e}"
                error = e
        op = _distributed.next_operation_id("tiers-copy-down")
        outcome = _distributed.broadcast_str(op, outcome)
        if outcome.startswith(("corrupt", "failed")):
            if self._primary:
                raise error
            cls = CorruptCheckpointError if outcome.startswith("corrupt") else CheckpointError
            raise cls(
                f"copying step {step} down from {self.remote} failed on the primary: "
                + outcome.split(": ", 1)[1]
            )
        return outcome == "present"

    def _ensure_local(self, step: int) -> bool:
        """Copies ``step`` down (see :meth:`ensure_local`): listed, copied into local
        staging, **verified there in full** (every JSON checksum, every chunk's crc32c:
        ``_verify.verify_step``), then committed. Proven damage (a checksum or format
        mismatch) sets the persistent copy aside (:meth:`_set_aside_remote`): it is never
        listed, copied down or counted again, and the step's number is free for the next
        save. Environmental errors (EMFILE, EIO, a timeout, a refused connection) raise
        and set nothing aside. A link or special file in it is no damage of its data:
        ForeignEntryError, nothing set aside."""
        local_final = _steps.step_location(self.local, step)
        if local_final.exists(MANIFEST_FILE):
            return True
        if step in self._damaged:
            raise CorruptCheckpointError(
                f"step {step} of {self.remote} was proven damaged when it was first copied "
                f"down, and is never copied down again: {self._damaged[step]}"
            )
        src = _steps.step_location(self.remote, step)
        with self._cond:
            self._reading.add(step)
        try:
            raw = src.read_bytes(MANIFEST_FILE)
            if raw is None:
                return False
            if self._owner is not None:  # the persistent path is still this run's
                self._owner.check(f"copying step {step} down from {self.remote}")
            # Our own dead remains there are cleared; a foreign entry raises, naming it.
            if _ownership.check_slot(local_final, what=f"step {step}", replace=False):
                _ownership.remove(local_final, action="clear the remains of a dead copy at")
            self.copied_down.append(step)
            try:
                manifest = _parse_manifest(raw, src, step)
                files = [f for f in _remote_files(src) if f != MANIFEST_FILE]
                _check_listed(manifest, files, str(src))
                t0 = time.perf_counter()
                staging = Staging.begin(local_final, secrets.token_hex(6))
                try:
                    nbytes = self._copy_files(
                        lambda rel: _read_remote_file(src, rel),
                        staging.location,
                        files,
                        manifest,
                        str(src),
                        restoring=True,
                    )
                    _verify_copy(staging.location, raw, step, src)
                    staging.location.sync()
                    staging.publish(MANIFEST_FILE, raw, replace=False)
                except BaseException:
                    staging.abort()
                    raise
            except ForeignEntryError:
                raise  # a planted link or FIFO: no damage of ours, nothing set aside
            except CorruptCheckpointError as e:
                self._set_aside_remote(step, raw, e)
                raise
        finally:
            with self._cond:
                self._reading.discard(step)
        logger.warning(
            "checkpoint: copied step %d down from %s to %s: %d bytes, %.3f s",
            step,
            self.remote,
            self.local,
            nbytes,
            time.perf_counter() - t0,
        )
        return True

    # ------------------------------------------------------------------ damaged copies

    def _read_damaged(self) -> dict[int, str]:
        """Primary, at open: the damaged steps recorded in :data:`DAMAGED_FILE` (object
        stores) whose manifest is still the one found damaged."""
        if self.remote.is_local:
            return {}
        raw = self.remote.read_bytes(DAMAGED_FILE)
        if raw is None:
            return {}
        where = f"{self.remote}/{DAMAGED_FILE}"
        try:
            doc = json.loads(raw)
            steps = doc["steps"]
            if doc.get("library") != "flax_orbax_plugin" or not isinstance(steps, dict):
                raise ValueError("not a damage record of this library")
            out = {}
            for name, info in steps.items():
                if not _steps.is_step_name(name) or not isinstance(info, dict):
                    raise ValueError(f"field steps: entry {name!r} is no step record")
                current = self.remote.child(name).read_bytes(MANIFEST_FILE)
                if current is not None and hashlib.sha256(current).hexdigest() == info.get(
                    "manifest_sha256"
                ):
                    out[int(name)] = str(info.get("error", ""))
            return out
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"{where}: expected this library's record of damaged steps, found {e}"
            ) from None

    def _write_damaged(self, damaged: dict[int, str], shas: dict[int, str]) -> None:
        doc = {
            "library": "flax_orbax_plugin",
            "kind": "damaged steps",
            "steps": {
                str(s): {"manifest_sha256": shas[s], "error": damaged[s][:2000]}
                for s in sorted(damaged)
                if s in shas
            },
        }
        self.remote.write_bytes(DAMAGED_FILE, json.dumps(doc, sort_keys=True).encode())

    def _set_aside_remote(self, step: int, raw: bytes, error: Exception) -> None:
        """Primary, after a verified copy-down proved the persistent copy damaged: on
        filesystems it is renamed to ``<step>.corrupt-<nonce>`` (never removed); on object
        stores, which cannot rename, it stays and is recorded in :data:`DAMAGED_FILE`
        (with its manifest's sha256). Either way it is never listed, copied down or
        counted again, and a new save of the step replaces it. Failing to set it aside
        is logged: the error raised is the damage."""
        text = str(error)
        with self._cond:
            self._known.discard(step)
        try:
            if self.remote.supports_rename:
                name = f"{step}.corrupt-{secrets.token_hex(6)}"
                _steps.step_location(self.remote, step).rename(self.remote.child(name))
                logger.warning(
                    "checkpoint: step %d of %s is damaged (%s); moved aside to %s",
                    step,
                    self.remote,
                    text,
                    name,
                )
                return
            self._damaged = {**self._damaged, step: text}
            shas = self._damaged_shas()
            shas[step] = hashlib.sha256(raw).hexdigest()
            self._write_damaged(self._damaged, shas)
            logger.warning(
                "checkpoint: step %d of %s is damaged (%s); recorded in %s, never copied "
                "down again",
                step,
                self.remote,
                text,
                DAMAGED_FILE,
            )
        except Exception as e:  # noqa: BLE001  (the damage is what gets raised)
            self._damaged = {**self._damaged, step: text}  # this process skips it anyway
            logger.warning(
                "checkpoint: could not set step %d of %s aside: %s", step, self.remote, e
            )

    def _damaged_shas(self) -> dict[int, str]:
        """The manifest sha256 of every damaged step recorded (object stores)."""
        out = {}
        for s in self._damaged:
            current = self.remote.child(str(s)).read_bytes(MANIFEST_FILE)
            if current is not None:
                out[s] = hashlib.sha256(current).hexdigest()
        return out

    def _forget_damaged(self, step: int) -> None:
        """Replicator, after committing ``step``: a damaged copy it replaced is gone."""
        if step not in self._damaged:
            return
        self._damaged = {s: e for s, e in self._damaged.items() if s != step}
        try:
            self._write_damaged(self._damaged, self._damaged_shas())
        except Exception as e:  # noqa: BLE001  (the stale entry no longer matches anyway)
            logger.warning("checkpoint: could not update %s/%s: %s", self.remote, DAMAGED_FILE, e)


# ---------------------------------------------------------------------- files


def _verify_copy(staging: Location, raw: bytes, step: int, src: Location) -> None:
    """Verifies a step copied into local staging before it is committed: the manifest
    is written there first (the pending marker still claims the place), then every
    item is read in full. CorruptCheckpointError naming the persistent file on damage;
    environmental errors propagate."""
    staging.write_bytes(MANIFEST_FILE, raw, durable=False)
    bad = [r for r in verify_step(staging, step) if not r.ok]
    if bad:
        raise CorruptCheckpointError(
            f"step {step} of {src} failed verification after its copy down (nothing was "
            f"committed locally): " + "; ".join(f"{r.item or 'manifest'}: {r.error}" for r in bad)
        )


def _local_files(root: str, step: int) -> list[str]:
    """Relative paths of the regular files under a local step directory, manifest and
    pending marker excluded (a crash window can leave the marker beside a committed
    manifest). A symlink or special file anywhere in it is a ForeignEntryError."""
    return sorted(_local_file_sizes(root, step))


def _local_file_sizes(root: str, step: int) -> dict[str, int]:
    """``{relative path: size}`` of :func:`_local_files`."""
    out: dict[str, int] = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        top = os.path.join(root, rel_dir) if rel_dir else root.rstrip("/")
        try:
            with os.scandir(top) as it:
                entries = list(it)
        except FileNotFoundError:
            raise CheckpointError(f"step {step}: {top} vanished while being replicated") from None
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stack.append(rel)
            elif stat.S_ISREG(st.st_mode):
                if rel not in (MANIFEST_FILE, _ownership.PENDING_FILE):
                    out[rel] = st.st_size
            else:
                found = "a symbolic link" if entry.is_symlink() else "a special file"
                raise ForeignEntryError(
                    f"step {step}: {entry.path}: expected a regular file or directory written "
                    f"by this library, found {found} (never followed or copied)"
                )
    return out


def _listing_digest(sizes: dict[str, int]) -> str:
    """sha256 of the sorted names and sizes: processes that saw the same files agree."""
    text = "".join(f"{rel}\t{sizes[rel]}\n" for rel in sorted(sizes))
    return hashlib.sha256(text.encode()).hexdigest()


def _partition(sizes: dict[str, int], n: int) -> list[list[str]]:
    """The files of a step split among ``n`` processes, the same on every process:
    largest first (ties by path), each to the least-loaded process (ties by index),
    a file weighing its size plus :data:`FILE_COST_BYTES`. Each share is sorted."""
    loads = [0] * n
    shares: list[list[str]] = [[] for _ in range(n)]
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        p = min(range(n), key=lambda i: (loads[i], i))
        shares[p].append(rel)
        loads[p] += sizes[rel] + FILE_COST_BYTES
    return [sorted(share) for share in shares]


def _check_statuses(statuses: list[dict[str, Any]], nfiles: int) -> int:
    """Primary: every process's status of a round, by index; returns the bytes copied,
    or raises :class:`_Stopped` (a process's tier closed meanwhile) or
    :class:`_RoundFailed` naming the processes that failed or saw other files, or when
    the shares together are not the ``nfiles`` files the primary listed."""
    if any(s.get("stopped") for s in statuses):
        raise _Stopped()
    failed = [f"process {p}: {s['error']}" for p, s in enumerate(statuses) if not s["ok"]]
    if failed:
        raise _RoundFailed("; ".join(failed))
    first = statuses[0]["listing"]
    other = [p for p, s in enumerate(statuses) if s["listing"] != first]
    if other:
        raise _RoundFailed(
            f"process(es) {', '.join(map(str, other))} listed other files under the local "
            f"step than process 0 (listing digests "
            + ", ".join(f"{p}: {s['listing'][:12]}" for p, s in enumerate(statuses))
            + "); is the local directory shared by every host?"
        )
    copied = sum(int(s["files"]) for s in statuses)
    if copied != nfiles:
        raise _RoundFailed(f"the processes copied {copied} files of the {nfiles} in the step")
    return sum(int(s["bytes"]) for s in statuses)


def _read_local_file(root: str, rel: str, step: int) -> bytes:
    """A file under a local step, of any size, never through a link (``read_bytes``)."""
    data = Location.from_path(root).read_bytes(rel, max_bytes=None)
    if data is None:
        raise CheckpointError(f"step {step}: {root}/{rel} vanished while being replicated")
    return data


def _remote_files(step_loc: Location) -> list[str]:
    if step_loc.is_local:
        return _local_files(step_loc.path, int(step_loc.name))
    keys = step_loc._kv().list().result()
    return sorted(k.decode("utf-8") for k in keys if k != _ownership.PENDING_FILE.encode())


def _read_remote_file(step_loc: Location, rel: str) -> bytes:
    if step_loc.is_local:
        return _read_local_file(step_loc.path, rel, int(step_loc.name))
    result = step_loc._kv().read(rel).result()
    if result.state != "value":
        raise CorruptCheckpointError(f"{step_loc}/{rel} is missing (it was listed a moment ago)")
    return bytes(result.value)


def _parse_manifest(raw: bytes, step_loc: Location, step: int) -> StepManifest:
    where = f"{step_loc}/{MANIFEST_FILE}"
    manifest = StepManifest.from_bytes(raw, where)
    if manifest.step != step:
        raise CorruptCheckpointError(
            f"{where}: field step: expected {step} (the directory's name), found {manifest.step}"
        )
    return manifest


def _check_listed(manifest: StepManifest, files: list[str], where: str) -> None:
    """Every JSON file the manifest lists is present (else the copy would be partial)."""
    present = set(files)
    missing = [f for f in manifest.files if f not in present]
    if missing:
        raise CorruptCheckpointError(
            f"{where}: files listed in {MANIFEST_FILE} are missing: "
            + ", ".join(sorted(missing)[:5])
        )
