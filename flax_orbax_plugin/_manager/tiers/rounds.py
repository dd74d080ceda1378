"""The replication rounds of several processes (see ``docs/tiers.md``).

The primary announces a round, every process copies its share and reports, the
primary commits or not and publishes the outcome. Every method runs on a replicator
thread (the primary's :meth:`Rounds.lead`, the others' :meth:`Rounds.follow`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from typing import Any

from ..._base import distributed as _distributed
from ..._core.save import Staging
from ..._errors import CheckpointError, ReplicationError
from ..._format import steps as _steps
from ..._format.layout import HOST_FILE, MANIFEST_FILE
from . import files as _files
from .state import Places, Stopped, TierState, Yielding

__all__ = ["POLL_S", "Round", "RoundFailed", "Rounds", "check_statuses"]

logger = logging.getLogger("flax_orbax_plugin")

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
    """The rounds of one tier: their key-value :attr:`prefix` (agreed at open) and the
    next round's number (the same sequence on every process; replicator thread only)."""

    def __init__(self, places: Places, state: TierState, yielding: Yielding):
        self._places = places
        self._state = state
        self._yielding = yielding
        self.prefix = ""
        self._round = 0
        # The rounds' region: a replicator thread's error published there ends the others' waits.
        self.region: _distributed.Region | None = None

    def start_region(self) -> None:
        """At open, once :attr:`prefix` is agreed: the rounds' region (several processes)."""
        if self._places.multi:
            self.region = _distributed.Region("tier-rounds", f"tier{self.prefix}")

    def copy(self, src: Any, dst: Any, files: list[str], manifest: Any) -> int:
        """``files`` of ``src`` copied into ``dst`` (yielding to the manager's saves,
        stopped with the tier, within its host memory); the bytes copied."""
        return _files.copy_files(
            src,
            dst,
            files,
            manifest,
            before_file=self._yielding.before_file,
            stopped=lambda: self._state.stop,
            memory_limit=self._places.memory_limit(),
        )

    def in_region(self, run) -> None:
        """Runs a replicator thread's ``run`` in the rounds' region."""
        with _distributed.resumed(self.region):
            run()

    def next_key(self) -> str:
        """Replicator thread: the key of this tier's next round."""
        key = f"{self.prefix}/{self._round}"
        self._round += 1
        return key

    # ------------------------------------------------------------------ the primary

    def announce(self, rnd: Round, decision: str) -> None:
        """Primary: publishes a round's decision (a JSON object, or ``stop``)."""
        _distributed.broadcast_str(rnd.key, decision, region=self.region)
        rnd.announced = True

    def finish(self, rnd: Round | None, outcome: str) -> None:
        """Primary: publishes a round's outcome; a round that never got to copying is
        announced with its outcome in it (the others then copy nothing)."""
        if rnd is None:
            return
        try:
            if rnd.announced:
                _distributed.broadcast_str(f"{rnd.key}/outcome", outcome, region=self.region)
            else:
                self.announce(rnd, json.dumps({"step": rnd.step, "outcome": outcome}))
        except Exception as e:  # noqa: BLE001  (the others learn it from the region)
            logger.warning("checkpoint: could not publish round %s: %s", rnd.key, e)
            if self.region is not None:  # they would wait for it: the rounds end here
                _distributed.publish_failure(self.region, e)

    def lead(self, rnd: Round, step: int, nonce: str, raw: bytes, nfiles: int | None) -> int:
        """Primary: announces ``step``, copies its own share, gathers every process's
        status; returns the bytes copied, or raises as :func:`check_statuses`."""
        sha = hashlib.sha256(raw).hexdigest()
        self.announce(rnd, json.dumps({"step": step, "staging": nonce, "manifest": sha}))
        statuses = [self.copy_share(step, nonce, sha, rnd.key)]
        for p in range(1, _distributed.process_count()):
            got = _distributed.get_from(f"{rnd.key}/status", p, region=self.region)
            statuses.append(json.loads(got))
        return check_statuses(statuses, nfiles)

    # ------------------------------------------------------------------ every process

    def copy_share(self, step: int, nonce: str, manifest_sha: str, key: str) -> dict[str, Any]:
        """Every process, in a round: copies its share of the local step's files into
        the remote staging; returns its status (raises only Stopped, on the primary)."""
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

    # ------------------------------------------------------------------ the others

    def follow(self) -> None:
        """The replicator thread of a process other than the primary: takes part in the
        primary's rounds, in order, until it announces ``stop``."""
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
        """:meth:`follow`'s rounds, in its region."""
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
            self._yielding.start()
            status = self.copy_share(step, info["staging"], info["manifest"], key)
            _distributed.publish(f"{key}/status", json.dumps(status), region=self.region)
            # The primary may spend up to one timeout gathering statuses.
            wait = 2 * _distributed.stall_timeout(region=self.region)
            said = f"{key}/outcome"
            outcome = _distributed.broadcast_str(said, None, region=self.region, timeout_s=wait)
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
            decision = _distributed.poll(key, region=self.region, wait_s=POLL_S)
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
    """Primary: the bytes copied by a round's ``statuses``, or Stopped, or RoundFailed
    naming the processes that failed or saw other files (or not ``nfiles`` copied)."""
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
    key: str,
    sizes,
    manifest,
    region: _distributed.Region | None,
    error: BaseException | None = None,
):
    """Each host's own directory, every process in a round: publishes its listing (or
    ``error``), gathers every host's; returns (its share of the union, the union's
    digest, its size). CheckpointError when the hosts' copies do not add up."""
    mine = {"error": f"{type(error).__name__}: {error}"} if error else {"sizes": sizes}
    _distributed.publish(key, json.dumps(mine), region=region)
    listings = [json.loads(v) for v in _distributed.gather_str(key, region=region)]
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
