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

Who calls what (one manager, one training thread, one replicator thread):

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
  persistent tier into the local one (staged, verified, renamed) when the step is
  newer than every local one, or its local copy is damaged;
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
wrote into), and so is the local tier here: the
**primary replicates the whole step** (it sees every process's files there), the
other processes' tiers do no copying: ``submit`` is a no-op on them, ``open``,
:meth:`agreed_steps` and :meth:`ensure_local` are collective (the primary lists or
copies, then shares the result with one key-value round), so every process restores
the same step or raises the same error.

Per-host local disks (not supported, by the tier nor by the manager's local commit)
would need: each host commits its own part locally (per-host staging, renamed on
each host after the primary's agreement), each host's replicator copies the files
under its own disk (its shards, batch files, ``data_iterator/process_<i>.json``; the
primary also the metadata), verifying the JSON checksums it can, and publishes one
status per step (step, manifest checksum, error or its keys) under
``fop/replicate/<step>``; the primary gathers every status (bounded by the
coordination timeout), writes the manifest remotely only if all succeeded for the
same manifest, and broadcasts the outcome, removing the uncommitted remote step on
failure. Which step to copy next (coalescing) is then the primary's decision,
broadcast, so every host copies the same steps; copy-down on restore would fetch,
per host, only the files that host's shards need.

Not handled: two writers replicating to one persistent location (there is no lock
on object stores). A step replaced locally with ``overwrite=True`` is replaced on a
filesystem tier atomically (rename), on an object store by first un-committing the
old copy (a window where the step is absent there, never partial).
"""

from __future__ import annotations

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

from . import _distributed, _faults, _steps
from ._commit import Staging
from ._errors import (
    CheckpointError,
    CorruptCheckpointError,
    ForeignEntryError,
    ReplicationError,
)
from ._layout import MANIFEST_FILE, StepManifest
from ._retention import RetentionPolicy, steps_to_delete
from ._storage import Location

__all__ = ["PersistentTier", "ReplicationError"]

logger = logging.getLogger("flax_orbax_plugin")

COPY_THREADS = 16  # files copied at once (object stores are latency-bound)
RETRIES = 2
RETRY_DELAY_S = 0.5
# A copy yields to the training loop's own save: it waits while a local save is in
# flight (before each step and each file), but no longer than this per step, so a
# loop that saves all the time still gets its steps replicated.
MAX_DEFER_S = 10.0


class _Stopped(Exception):
    """The tier is closing: the copy in progress was abandoned (uncommitted)."""


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
        # any manager directory): the primary replicates; see the module docstring.
        self._primary = _distributed.is_primary()
        self._multi = _distributed.process_count() > 1
        if not grace_seconds >= 0:
            raise ValueError(f"persistent_grace_seconds must be >= 0, found {grace_seconds!r}")
        self.retention = RetentionPolicy(keep_last=keep, keep_every=keep_every)
        self.grace_seconds = float(grace_seconds)
        self._remove_step = remove_step
        self._busy = busy
        self._defer_until = 0.0  # replicator: the deadline of the current step's yielding
        self._cond = threading.Condition()
        self._queue: set[int] = set()  # guarded by _cond, like the fields below
        self._current: int | None = None
        self._reading: set[int] = set()  # steps being copied down: not deleted remotely
        self._known: set[int] = set()  # committed remotely, as far as this tier knows
        self._stop = False
        self._error: ReplicationError | None = None
        self._thread: threading.Thread | None = None
        self.replicated: list[int] = []  # steps copied by this tier, in order (for tests)

    # ------------------------------------------------------------------ lifecycle

    def open(self, local_steps: Iterable[int]) -> None:
        """Cleans the persistent tier's unfinished copies, queues the local steps it lacks
        (see the module docstring) and starts the replicator thread. Collective: every
        process calls it; the primary does the work and shares the listing."""
        remote_steps: list[int] = []
        if self._primary:
            self._remove_unfinished()
            remote_steps = _steps.committed_steps(self.remote)
        if self._multi:
            op = _distributed.next_operation_id("tiers-open")
            remote_steps = json.loads(_distributed.broadcast_str(op, json.dumps(remote_steps)))
        with self._cond:
            self._known = set(remote_steps)
        if not self._primary:
            return  # the replicator runs on the primary only
        latest = remote_steps[-1] if remote_steps else -1
        every = self.retention.keep_every
        missing = [
            s
            for s in local_steps
            if s not in remote_steps and (s > latest or (every is not None and s % every == 0))
        ]
        with self._cond:
            for s in missing:
                self._enqueue(s)
        if missing:
            logger.info("checkpoint: replicating local steps %s to %s", missing, self.remote)
        self._thread = threading.Thread(target=self._run, name="fop-replicate", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Queues a step just committed locally (called after each local commit, on
        every process; a no-op but on the primary)."""
        if not self._primary:
            return
        with self._cond:
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
        """Steps committed in the persistent tier now (lists the store)."""
        return _steps.committed_steps(self.remote)

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
        (once)."""
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
        copy still running is abandoned uncommitted). Idempotent."""
        if self._stop and (self._thread is None or not self._thread.is_alive()):
            return
        try:
            done = self.wait(timeout) if raise_errors else self._wait_quietly(timeout)
        finally:
            with self._cond:
                self._stop = True
                left = sorted(self._queue | ({self._current} - {None}))
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join(60)
        if not done and left:
            logger.warning(
                "checkpoint: steps %s not yet replicated to %s (within %s s); they will be "
                "replicated when a manager next opens %s",
                left,
                self.remote,
                timeout,
                self.local,
            )

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
        every = self.retention.keep_every
        self._queue = {s for s in self._queue if s > step or (every is not None and s % every == 0)}
        self._queue.add(step)

    def _run(self) -> None:
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

    def _replicate_with_retries(self, step: int) -> None:
        for attempt in range(RETRIES + 1):
            try:
                if self._replicate(step):
                    self._apply_retention(step)
                return
            except _Stopped:
                return
            except Exception as e:  # noqa: BLE001  (kept and raised by wait/close)
                if attempt < RETRIES and not isinstance(e, CorruptCheckpointError):
                    logger.warning("checkpoint: replicating step %d failed, retrying: %s", step, e)
                    time.sleep(RETRY_DELAY_S * (attempt + 1))
                    continue
                error = ReplicationError(
                    f"step {step} of {self.local} was not replicated to {self.remote}: "
                    f"{type(e).__name__}: {e}"
                )
                error.__cause__ = e
                logger.error("checkpoint: %s", error)
                with self._cond:
                    self._error = error
                return

    def _replicate(self, step: int) -> bool:
        """Copies one committed local step; returns False when there was nothing to do."""
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
        t0 = time.perf_counter()
        staging = Staging.begin(final, secrets.token_hex(6))
        if not staging.renames and final.is_dir():
            final.delete(MANIFEST_FILE)  # an older copy or a dead copy's files: uncommit
            final.remove()
        try:
            nbytes = self._copy_files(
                lambda rel: _read_local_file(src.path, rel, step),
                staging.location,
                files,
                manifest,
                str(src),
            )
            staging.location.sync()
            staging.publish(MANIFEST_FILE, raw, replace=True)  # the remote commit, last
        except BaseException:
            try:  # nothing partial stays: it would never be listed, but it takes space
                staging.abort() if staging.renames else final.remove()
            except Exception:  # noqa: BLE001
                pass
            raise
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

    def _copy_files(
        self, read, dst: Location, files, manifest: StepManifest, src: str, restoring=False
    ) -> int:
        """Copies ``files`` (relative paths) into ``dst``, checking the sha256 of each
        JSON file the manifest lists; the manifest itself is not among them. A copy up
        (not ``restoring``) yields to local saves."""

        def one(rel: str) -> int:
            if not restoring:
                self._yield_to_saves()
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
        steps = self.steps()
        with self._cond:
            protected = {just_copied} | self._reading
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
        """The persistent tier's copies that never committed: ``.partial-``/``.deleting-``
        directories (filesystems) or digits-named prefixes without a manifest (object
        stores). Foreign entries of a filesystem are left alone."""
        listing = _steps.list_directory(self.remote)
        for name in listing.unfinished:
            logger.info("checkpoint: removing unfinished copy %s/%s", self.remote, name)
            self.remote.child(name).remove()
        if not self.remote.is_local:
            for name in listing.foreign:
                if _steps.is_step_name(name):
                    logger.info("checkpoint: removing uncommitted copy %s/%s", self.remote, name)
                    self.remote.child(name).remove()

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
        if self.local.child(str(step)).exists(MANIFEST_FILE):
            return True
        src = _steps.step_location(self.remote, step)
        with self._cond:
            self._reading.add(step)
        try:
            raw = src.read_bytes(MANIFEST_FILE)
            if raw is None:
                return False
            manifest = _parse_manifest(raw, src, step)
            files = [f for f in _remote_files(src) if f != MANIFEST_FILE]
            _check_listed(manifest, files, str(src))
            t0 = time.perf_counter()
            staging = Staging.begin(_steps.step_location(self.local, step), secrets.token_hex(6))
            try:
                nbytes = self._copy_files(
                    lambda rel: _read_remote_file(src, rel),
                    staging.location,
                    files,
                    manifest,
                    str(src),
                    restoring=True,
                )
                staging.location.sync()
                staging.publish(MANIFEST_FILE, raw, replace=False)
            except BaseException:
                staging.abort()
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


# ---------------------------------------------------------------------- files


def _local_files(root: str, step: int) -> list[str]:
    """Relative paths of the regular files under a local step directory, manifest
    excluded. A symlink or special file anywhere in it is a ForeignEntryError."""
    out: list[str] = []
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
                if rel != MANIFEST_FILE:
                    out.append(rel)
            else:
                found = "a symbolic link" if entry.is_symlink() else "a special file"
                raise ForeignEntryError(
                    f"step {step}: {entry.path}: expected a regular file or directory written "
                    f"by this library, found {found} (never followed or copied)"
                )
    return sorted(out)


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
    return sorted(k.decode("utf-8") for k in keys)


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
