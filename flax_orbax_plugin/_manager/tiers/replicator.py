"""Replication to the persistent tier (see ``docs/tiers.md``).

:meth:`Replicator.run` is the primary's replicator thread: the newest queued step
(retried), then the persistent retention; a failure is kept as the tier's error. With
several processes each copy is a round (:class:`Rounds`) the others take part in on
their replicator thread (:meth:`Rounds.follow`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import secrets
import time
from typing import Any

from ..._base import distributed as _distributed
from ..._base import env as _env
from ..._core import ownership as _ownership
from ..._core import removing as _removing
from ..._core.save import Staging
from ..._errors import (
    CheckpointError,
    CoordinationError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ReplicationError,
)
from ..._format import steps as _steps
from ..._format.layout import HOST_FILE, MANIFEST_FILE, StepManifest
from ..events import StepReplicated, measure_stored
from ..retention import steps_to_delete
from . import files as _files
from .copy_down import DamagedSteps
from .state import Places, Stopped, TierState

logger = logging.getLogger("flax_orbax_plugin")

RETRIES = 2
# The pause before the n-th retry is n times this (read once, at import).
RETRY_DELAY_S = _env.read("FOP_TIER_RETRY_DELAY_S")
POLL_S = 0.5  # other processes: how long one wait for the primary's next round lasts


class RoundFailed(CheckpointError):
    """A round in which some process failed, or the processes saw different files."""


@dataclasses.dataclass
class Round:
    """One replication round: its key-value name, its step, announced yet."""

    key: str
    step: int
    announced: bool = False


class Rounds:
    """The rounds of one tier: their :attr:`prefix` and next number (replicator thread)."""

    def __init__(self, places: Places, state: TierState):
        self._places = places
        self._state = state
        self.prefix = ""
        self._round = 0
        # The rounds' region: a replicator thread's error published there ends the others' waits.
        self.region = _distributed.Region("tier-rounds")

    def start_region(self) -> None:
        """At open, once :attr:`prefix` is agreed: the rounds' region (several processes)."""
        if self._places.multi:
            self.region = _distributed.Region("tier-rounds", f"tier{self.prefix}")

    def copy(self, src: Any, dst: Any, files: list[str], manifest: Any) -> int:
        """``files`` of ``src`` copied into ``dst`` (yielding to saves); the bytes copied."""
        return _files.copy_files(
            src,
            dst,
            files,
            manifest,
            before_file=self._state.before_file,
            stopped=lambda: self._state.stop,
            memory_limit=self._places.memory_limit(),
        )

    def in_region(self, run) -> None:
        with self.region.resumed():
            run()

    def next_key(self) -> str:
        """Replicator thread: the key of this tier's next round."""
        key = f"{self.prefix}/{self._round}"
        self._round += 1
        return key

    def announce(self, rnd: Round, decision: str) -> None:
        """Primary: publishes a round's decision (a JSON object, or ``stop``)."""
        self.region.broadcast_str(rnd.key, decision)
        rnd.announced = True

    def finish(self, rnd: Round | None, outcome: str) -> None:
        """Primary: publishes a round's outcome (announced with it when nothing was copied)."""
        if rnd is None:
            return
        try:
            if rnd.announced:
                self.region.broadcast_str(f"{rnd.key}/outcome", outcome)
            else:
                self.announce(rnd, json.dumps({"step": rnd.step, "outcome": outcome}))
        except Exception as e:  # noqa: BLE001  (the others learn it from the region)
            logger.warning("checkpoint: could not publish round %s: %s", rnd.key, e)
            if self.region.spans:  # they would wait for it: the rounds end here
                _distributed.publish_failure(self.region, e)

    def lead(self, rnd: Round, step: int, nonce: str, raw: bytes, nfiles: int | None) -> int:
        """Primary: announces ``step``, copies its share, gathers the statuses; bytes copied."""
        sha = hashlib.sha256(raw).hexdigest()
        self.announce(rnd, json.dumps({"step": step, "staging": nonce, "manifest": sha}))
        statuses = [self.copy_share(step, nonce, sha, rnd.key)]
        for p in range(1, _distributed.process_count()):
            got = self.region.get_from(f"{rnd.key}/status", p)
            statuses.append(json.loads(got))
        return check_statuses(statuses, nfiles)

    def copy_share(self, step: int, nonce: str, manifest_sha: str, key: str) -> dict[str, Any]:
        """Every process, in a round: copies its share into the remote staging; its status."""
        listing, total = None, None
        per_host = self._places.per_host
        try:
            src = _steps.step_location(self._places.local, step)
            try:
                manifest, sizes = self._list(src, step, manifest_sha)
            except Exception as e:
                if per_host:  # the others wait for this listing: they get the error
                    share_of_hosts(f"{key}/listing", None, None, self.region, e)
                raise
            if per_host:
                listed = share_of_hosts(f"{key}/listing", sizes, manifest, self.region)
                share, listing, total = listed
            else:
                listing = _files.listing_digest(sizes)
                count, index = _distributed.process_count(), _distributed.process_index()
                share = _files.partition(sizes, count)[index]
            staging = Staging.begin(_steps.step_location(self._places.remote, step), nonce)
            nbytes = self.copy(src, staging.location, share, manifest)
            staging.location.sync()  # this process's files: durable before it reports
        except Stopped:
            if self._places.primary:
                raise
            return {"ok": False, "stopped": True, "listing": listing, "error": "closed"}
        except Exception as e:  # noqa: BLE001  (reported to the primary)
            return {"ok": False, "listing": listing, "error": f"{type(e).__name__}: {e}"}
        self._state.copied_files[step] = share
        return {
            "ok": True,
            "listing": listing,
            "bytes": nbytes,
            "files": len(share),
            "total": total,
        }

    def _list(self, src, step: int, manifest_sha: str):
        """The local step's manifest (as the primary read it) and ``{file: size}``."""
        raw = src.read_bytes(MANIFEST_FILE)
        if raw is None:
            raise CheckpointError(f"step {step}: {src}/{MANIFEST_FILE} vanished")
        if hashlib.sha256(raw).hexdigest() != manifest_sha:
            raise CheckpointError(
                f"step {step}: {src}/{MANIFEST_FILE} differs from the one the primary read"
            )
        manifest = _files.parse_manifest(raw, src, step)
        sizes = _files.local_file_sizes(src.path, step)
        if self._places.per_host:
            sizes.pop(HOST_FILE, None)  # this host's marker stays here
        return manifest, sizes

    def follow(self) -> None:
        """A non-primary's replicator thread: the primary's rounds, in order, until ``stop``."""
        try:
            self.in_region(self._follow)
        except Exception as e:  # noqa: BLE001  (the primary is gone or late)
            error = ReplicationError(
                f"process {_distributed.process_index()} lost the primary's replication "
                f"rounds of {self._places.local} to {self._places.remote}: "
                f"{type(e).__name__}: {e}"
            )
            error.__cause__ = e
            logger.error("checkpoint: %s", error)
            with self._state.cond:
                self._state.error = error
                self._state.cond.notify_all()

    def _follow(self) -> None:
        state = self._state
        while True:
            key = self.next_key()
            decision = self._await_round(key)
            if decision is None or decision == "stop":
                return
            info = json.loads(decision)
            step = int(info["step"])
            with state.cond:
                state.round_steps.add(step)
                state.drop_older(step, self._places.kept_forever)
                state.queue.discard(step)
                state.current = step
            try:
                self._take_part(key, step, info)
            finally:
                with state.cond:
                    state.current = None
                    state.cond.notify_all()

    def _take_part(self, key: str, step: int, info: dict[str, Any]) -> None:
        """Follower: copies its share of round ``key``, reports it, settles the outcome."""
        outcome = info.get("outcome")
        if outcome is None:
            self._state.start_yielding()
            status = self.copy_share(step, info["staging"], info["manifest"], key)
            self.region.publish(f"{key}/status", json.dumps(status))
            # The primary may spend up to one timeout gathering statuses.
            wait = 2 * self.region.stall_timeout()
            outcome = self.region.broadcast_str(f"{key}/outcome", None, timeout_s=wait)
        self._settle(step, outcome)

    def _await_round(self, key: str) -> str | None:
        """Follower: the primary's decision under ``key``; None when this tier stops."""
        start = time.monotonic()
        while True:
            with self._state.cond:
                if self._state.stop:
                    return None
                since = self._state.closing_since
            waited = None if since is None else time.monotonic() - max(since, start)
            if waited is not None and waited > _distributed.DEFAULT_TIMEOUT_S:
                logger.warning(
                    "checkpoint: the primary announced no replication round (%s) within %.0f s "
                    "of close; not following it further",
                    key,
                    _distributed.DEFAULT_TIMEOUT_S,
                )
                return None
            decision = self.region.poll(key, wait_s=POLL_S)
            if decision is not None:
                return decision

    def _settle(self, step: int, outcome: str) -> None:
        """Follower: applies the outcome of the primary's round for ``step``."""
        state = self._state
        with state.cond:
            if outcome == "committed":
                state.known.add(step)
                state.replicated.append(step)
            elif outcome.startswith("retry:"):
                state.queue.add(step)  # the primary runs another round of it
            elif outcome.startswith("failed:"):
                state.error = ReplicationError(outcome.split(": ", 1)[1])
            # skipped, abandoned: nothing committed, no error (the next open retries)
            if outcome != "committed":
                state.copied_files.pop(step, None)


def check_statuses(statuses: list[dict[str, Any]], nfiles: int | None) -> int:
    """Primary: the bytes copied by a round's ``statuses``, or Stopped, or RoundFailed."""
    if any(s.get("stopped") for s in statuses):
        raise Stopped()
    failed = [f"process {p}: {s['error']}" for p, s in enumerate(statuses) if not s["ok"]]
    if failed:
        raise RoundFailed("; ".join(failed))
    first = statuses[0]["listing"]
    other = [p for p, s in enumerate(statuses) if s["listing"] != first]
    if other:
        raise RoundFailed(
            f"process(es) {', '.join(map(str, other))} listed other files under the local "
            f"step than process 0 (listing digests "
            + ", ".join(f"{p}: {s['listing'][:12]}" for p, s in enumerate(statuses))
            + "); is the local directory shared by every host?"
        )
    copied = sum(int(s["files"]) for s in statuses)
    if nfiles is None:  # each host's own directory: the union of their listings
        nfiles = int(statuses[0]["total"])
    if copied != nfiles:
        raise RoundFailed(f"the processes copied {copied} files of the {nfiles} in the step")
    return sum(int(s["bytes"]) for s in statuses)


def share_of_hosts(
    key: str, sizes, manifest, region: _distributed.Region, error: BaseException | None = None
):
    """Each host's own directory, every process in a round: its listing (or ``error``)
    shared; returns its share of the union, the union's digest and its size."""
    mine = {"error": f"{type(error).__name__}: {error}"} if error else {"sizes": sizes}
    region.publish(key, json.dumps(mine))
    listings = [json.loads(v) for v in region.gather_str(key)]
    if error is not None:
        return [], None, None
    failed = [f"process {p}: {v['error']}" for p, v in enumerate(listings) if "error" in v]
    if failed:
        raise CheckpointError("a host could not list its copy: " + "; ".join(failed))
    union: dict[str, int] = {}
    holders: dict[str, list[int]] = {}
    for p, v in enumerate(listings):
        for rel, size in v["sizes"].items():
            if union.setdefault(rel, size) != size:
                raise CheckpointError(
                    f"{rel}: process {holders[rel][0]} holds {union[rel]} bytes, process "
                    f"{p} {size}: the hosts' copies of the step differ"
                )
            holders.setdefault(rel, []).append(p)
    _files.check_listed(manifest, list(union), "the hosts' copies together")
    share = _files.partition(union, len(listings), holders)[_distributed.process_index()]
    return share, _files.listing_digest(union), len(union)


class Replicator:
    """Copies the primary's queued steps to the persistent tier."""

    def __init__(self, places: Places, state: TierState, rounds: Rounds, damaged: DamagedSteps):
        self._places = places
        self._state = state
        self._rounds = rounds
        self._damaged = damaged

    def run(self) -> None:
        """The primary's replicator thread, until the tier stops (then ``stop`` announced)."""
        state = self._state
        try:
            while True:
                with state.cond:
                    while not state.queue and not state.stop:
                        state.cond.wait()
                state.start_yielding()
                state.yield_to_save()  # then take the newest step, maybe the one just saved
                with state.cond:
                    if state.stop:
                        return
                    step = max(state.queue)
                    state.queue.discard(step)
                    state.current = step
                try:
                    self.replicate_with_retries(step)
                finally:
                    with state.cond:
                        state.current = None
                        state.cond.notify_all()
        finally:
            if self._places.multi:  # the other processes' replicators follow until this
                try:
                    self._rounds.announce(Round(self._rounds.next_key(), -1), "stop")
                except Exception as e:  # noqa: BLE001  (they give up after the timeout)
                    logger.warning("checkpoint: could not end the replication rounds: %s", e)

    def replicate_with_retries(self, step: int) -> None:
        """One queued step copied, retried (:data:`RETRIES`), then kept as the tier's error."""
        for attempt in range(RETRIES + 1):
            rnd = Round(self._rounds.next_key(), step) if self._places.multi else None
            before = _steps.step_location(self._places.local, step).read_bytes(MANIFEST_FILE)
            try:
                committed = self._replicate(step, rnd)
                self._rounds.finish(rnd, "committed" if committed else "skipped")
                if committed:
                    self._apply_retention(step)
                return
            except Stopped:
                self._rounds.finish(rnd, "abandoned")
                return
            except Exception as e:  # noqa: BLE001  (kept and raised by wait/close)
                if not self._failed(step, attempt, rnd, before, e):
                    return
                time.sleep(RETRY_DELAY_S * (attempt + 1))

    def _failed(
        self, step: int, attempt: int, rnd: Round | None, before: bytes | None, e: Exception
    ) -> bool:
        """An attempt failed with ``e``: logged, its round finished; whether to retry."""
        try:  # overwrite=True replaced the local step mid-copy? (unknown: the error stands)
            now = _steps.step_location(self._places.local, step).read_bytes(MANIFEST_FILE)
        except Exception:  # noqa: BLE001
            now = before
        if before is not None and now != before:
            # what was read is a mix of two versions, no damage; the new one was queued
            logger.info(
                "checkpoint: step %d was replaced locally while being copied; the "
                "new version is copied instead (%s)",
                step,
                e,
            )
            self._rounds.finish(rnd, "skipped")
            return False
        retry = attempt < RETRIES and not isinstance(
            e, (CorruptCheckpointError, CoordinationError, DirectoryLockedError)
        )
        detail = str(e) if isinstance(e, RoundFailed) else f"{type(e).__name__}: {e}"
        if retry:
            logger.warning("checkpoint: replicating step %d failed, retrying: %s", step, detail)
            self._rounds.finish(rnd, f"retry: {detail}")
            return True
        local, remote = self._places.local, self._places.remote
        error = ReplicationError(f"step {step} of {local} was not replicated to {remote}: {detail}")
        error.__cause__ = e
        logger.error("checkpoint: %s", error)
        self._state.events.save_failed(step, str(remote), "replication", error)
        with self._state.cond:
            self._state.error = error
        self._rounds.finish(rnd, f"failed: {error}")
        return False

    def _replicate(self, step: int, rnd: Round | None) -> bool:
        """Copies one committed local step; False when there was nothing to do."""
        places, state = self._places, self._state
        src = _steps.step_location(places.local, step)
        raw = src.read_bytes(MANIFEST_FILE)
        if raw is None:  # deleted locally (retention, a wiped directory) meanwhile
            logger.info("checkpoint: step %d is gone from %s; not replicated", step, places.local)
            return False
        manifest = _files.parse_manifest(raw, src, step)
        final = _steps.step_location(places.remote, step)
        if final.read_bytes(MANIFEST_FILE) == raw:
            with state.cond:
                state.known.add(step)
            return False  # already there (a restart after the commit, or copied down)
        files = _files.local_files(src.path, step)
        if not places.per_host:  # each host's own: the round checks the hosts' union
            _files.check_listed(manifest, files, str(src))
        if state.owner is not None:
            state.owner.renew()  # at each step too; raises if another run took the path
        # A foreign entry with the step's name is never written into nor replaced.
        what = f"step {step} of the persistent tier"
        found = _ownership.check_slot(final, what=what, replace=True)
        t0 = time.perf_counter()
        if not final.supports_rename and found == "step manifest":
            places.remove_step(places.remote, step)  # an older copy of ours: uncommit, remove
        elif not final.supports_rename and found is not None:
            _ownership.remove(final, action="clear the remains of a dead copy at", step=step)
        nbytes = self._commit(step, rnd, raw, manifest, files)
        self._damaged.forget(step)  # a good copy replaced a damaged one
        with state.cond:
            state.known.add(step)
        state.replicated.append(step)
        seconds = time.perf_counter() - t0
        logger.info(
            "checkpoint: replicated step %d to %s: %d files, %d bytes, %.3f s",
            step,
            places.remote,
            len(files),
            nbytes,
            seconds,
        )
        stored, where = measure_stored(final) or (None, None), str(places.remote)
        state.events.emit(StepReplicated(step, where, seconds, *stored, nbytes))
        return True

    def _commit(
        self, step: int, rnd: Round | None, raw: bytes, manifest: StepManifest, files: list[str]
    ) -> int:
        """Copies ``files`` (in round ``rnd``: this process's share), then commits the
        manifest, last; nothing partial stays. Returns the bytes copied."""
        src = _steps.step_location(self._places.local, step)
        final = _steps.step_location(self._places.remote, step)
        nonce = secrets.token_hex(6)
        staging = Staging.begin(final, nonce)
        try:
            if rnd is None:
                nbytes = self._rounds.copy(src, staging.location, files, manifest)
                self._state.copied_files[step] = files
            else:
                nfiles = None if self._places.per_host else len(files)
                nbytes = self._rounds.lead(rnd, step, nonce, raw, nfiles)
            staging.location.sync()
            if self._state.owner is not None:
                self._state.owner.raise_if_lost()
            staging.publish(MANIFEST_FILE, raw, replace=True)  # the remote commit, last
        except BaseException:
            try:  # nothing partial stays: it would never be listed, but it takes space
                if staging.renames:
                    staging.abort()
                else:
                    _removing.remove_if_ours(final, what="uncommitted copy")
            except Exception:  # noqa: BLE001
                pass
            raise
        return nbytes

    def _apply_retention(self, just_copied: int) -> None:
        places, state = self._places, self._state
        if not places.retention.deletes_anything:
            return
        try:
            steps = self._damaged.committed_steps()
        except Exception as e:  # noqa: BLE001  (the step is committed: retention waits)
            logger.warning("checkpoint: cannot list %s for retention: %s", places.remote, e)
            return
        with state.cond:
            protected = {just_copied} | state.reading
        # the damaged steps are left out: kept, as a step set aside, for inspection
        removed = []
        for s in steps_to_delete(steps, places.retention, protected=protected):
            with state.cond:
                if s in state.reading:
                    continue
                state.known.discard(s)
            try:
                places.remove_step(places.remote, s)
                removed.append(s)
            except Exception as e:  # noqa: BLE001  (retention is retried after the next copy)
                logger.warning(
                    "checkpoint: could not delete step %d of %s: %s", s, places.remote, e
                )
        state.events.steps_removed(just_copied, str(places.remote), removed, "persistent")
