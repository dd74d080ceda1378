"""The primary's replicator (see ``docs/tiers.md``): :meth:`Replicator.run` is its
thread, copying the newest queued step (retried, in a round with several processes),
then the persistent retention; a failure is kept as the tier's error.
"""

from __future__ import annotations

import logging
import secrets
import time

from ..._base import env as _env
from ..._core import ownership as _ownership
from ..._core import removing as _removing
from ..._core.save import Staging
from ..._errors import (
    CoordinationError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ReplicationError,
)
from ..._format import steps as _steps
from ..._format.layout import MANIFEST_FILE, StepManifest
from ..._storage.location import Location
from ..events import StepReplicated, measure_stored
from ..retention import steps_to_delete
from . import files as _files
from .damaged import DamagedSteps
from .rounds import Round, RoundFailed, Rounds
from .state import Places, Stopped, TierState, Yielding

__all__ = ["RETRIES", "RETRY_DELAY_S", "Replicator", "remove_unfinished"]

logger = logging.getLogger("flax_orbax_plugin")

RETRIES = 2
# The pause before the n-th retry is n times this (read once, at import).
RETRY_DELAY_S = _env.read("FOP_TIER_RETRY_DELAY_S")


class Replicator:
    """Copies the primary's queued steps to the persistent tier (``rounds``: with the
    other processes; ``damaged``: steps a good copy replaces)."""

    def __init__(
        self,
        places: Places,
        state: TierState,
        yielding: Yielding,
        rounds: Rounds,
        damaged: DamagedSteps,
    ):
        self._places = places
        self._state = state
        self._yielding = yielding
        self._rounds = rounds
        self._damaged = damaged

    def run(self) -> None:
        """The primary's replicator thread, until the tier stops; with several
        processes it then announces ``stop`` to the others' replicators."""
        state = self._state
        try:
            while True:
                with state.cond:
                    while not state.queue and not state.stop:
                        state.cond.wait()
                self._yielding.start()
                self._yielding.wait()  # then take the newest step, maybe the one just saved
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
        """One queued step: copied, each attempt a round with several processes; a
        failure is retried (:data:`RETRIES`), then kept as the tier's error."""
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
        if self._replaced_meanwhile(step, before):
            # overwrite=True replaced the local step mid-copy: what was read is a
            # mix of two versions, no damage; the new version was queued itself.
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

    def _replaced_meanwhile(self, step: int, before: bytes | None) -> bool:
        """Whether the local step's manifest changed since ``before`` was read."""
        try:
            now = _steps.step_location(self._places.local, step).read_bytes(MANIFEST_FILE)
        except Exception:  # noqa: BLE001  (unknown: the error stands as it is)
            return False
        return before is not None and now != before

    def _replicate(self, step: int, rnd: Round | None) -> bool:
        """Copies one committed local step (``rnd``: every process its share, the primary
        commits); returns False when there was nothing to do."""
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
        found = _ownership.check_slot(
            final, what=f"step {step} of the persistent tier", replace=True
        )
        t0 = time.perf_counter()
        nonce = secrets.token_hex(6)
        if not final.supports_rename and found == "step manifest":
            places.remove_step(places.remote, step)  # an older copy of ours: uncommit, remove
        elif not final.supports_rename and found is not None:
            _ownership.remove(final, action="clear the remains of a dead copy at", step=step)
        nbytes = self._commit(step, rnd, src, raw, manifest, files, final, nonce)
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
        self,
        step: int,
        rnd: Round | None,
        src: Location,
        raw: bytes,
        manifest: StepManifest,
        files: list[str],
        final: Location,
        nonce: str,
    ) -> int:
        """Copies ``files`` (or in round ``rnd`` this process's share) into the step's
        remote staging, then commits the manifest, last; nothing partial stays. Returns
        the bytes copied."""
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


def remove_unfinished(remote: Location) -> None:
    """Primary, at open: removes the persistent tier's copies that never committed,
    each only once proven ours (``_ownership``); everything else is left alone."""
    listing = _steps.list_directory(remote)
    for name in listing.unfinished:
        _removing.remove_if_ours(remote.child(name), what="unfinished copy")
    if not remote.is_local:
        for name in listing.foreign:
            if _steps.is_step_name(name):
                _removing.remove_if_ours(remote.child(name), what="uncommitted copy")
