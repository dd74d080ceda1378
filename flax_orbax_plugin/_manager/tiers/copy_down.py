"""Copy-down: a persistent step made a committed local one (see ``docs/tiers.md``).

Copied into local staging, **verified there in full**, then committed; proven damage
sets the persistent copy aside, environmental errors set nothing aside. Training
thread, on restore; collective with several processes.
"""

from __future__ import annotations

import logging
import secrets
import time

from ..._base import distributed as _distributed
from ..._base import env as _env
from ..._core import ownership as _ownership
from ..._core.save import Staging
from ..._core.verify import verify_step, window_bytes
from ..._errors import CheckpointError, CorruptCheckpointError, ForeignEntryError
from ..._format import steps as _steps
from ..._format.layout import HOST_FILE, MANIFEST_FILE
from ..._storage.location import Location
from . import files as _files
from .damaged import DamagedSteps
from .state import Places, TierState

__all__ = ["CopyDown"]

logger = logging.getLogger("flax_orbax_plugin")


class CopyDown:
    """Copies persistent steps down into the local tier, for restore (``damaged``: the
    steps proven damaged, never copied down again)."""

    def __init__(self, places: Places, state: TierState, damaged: DamagedSteps):
        self._places = places
        self._state = state
        self._damaged = damaged

    def ensure_local(self, step: int, region: _distributed.Region | None) -> bool:
        """Training thread, on restore: makes ``step`` a committed local step, copying it
        down when the local tier lacks it; False when neither tier has it;
        CorruptCheckpointError (nothing left locally) when the copy fails its checks.
        Collective (in ``region``): the primary copies and shares the outcome."""
        if not self._places.multi:
            return self._ensure_local(step)
        if self._places.per_host:
            return self._each_ensure_local(step, region)
        outcome, error = self._outcome(step) if self._places.primary else ("absent", None)
        op = _distributed.next_operation_id("tiers-copy-down", region=region)
        outcome = _distributed.broadcast_str(op, outcome, region=region)
        if outcome.startswith(("corrupt", "failed")):
            if self._places.primary:
                raise error
            raise _error_class(outcome)(
                f"copying step {step} down from {self._places.remote} failed on the primary: "
                + outcome.split(": ", 1)[1]
            )
        return outcome == "present"

    def _each_ensure_local(self, step: int, region: _distributed.Region | None) -> bool:
        """Each host's own directory: every process copies the step down into its own,
        then the outcomes are shared: all restore it, or all raise."""
        outcome, error = self._outcome(step)
        op = _distributed.next_operation_id("tiers-copy-down", region=region)
        _distributed.publish(op, outcome, region=region)
        outcomes = _distributed.gather_str(op, region=region)
        if error is not None:
            raise error
        bad = [(p, o) for p, o in enumerate(outcomes) if o.startswith(("corrupt", "failed"))]
        if bad:
            raise _error_class(bad[0][1])(
                f"copying step {step} down from {self._places.remote} failed on "
                + "; ".join(f"process {p}: {o.split(': ', 1)[1]}" for p, o in bad)
            )
        return all(o == "present" for o in outcomes)

    def _outcome(self, step: int) -> tuple[str, Exception | None]:
        """This process's copy down of ``step`` as the word it shares, and its error."""
        try:
            return ("present" if self._ensure_local(step) else "absent"), None
        except Exception as e:  # noqa: BLE001  (every process raises it, once shared)
            kind = "corrupt" if isinstance(e, CorruptCheckpointError) else "failed"
            return f"{kind}: {type(e).__name__}: {e}", e

    def _ensure_local(self, step: int) -> bool:
        """Copies ``step`` down (see the module docstring); proven damage sets the
        persistent copy aside, environmental errors and foreign entries do not."""
        local, remote, state = self._places.local, self._places.remote, self._state
        local_final = _steps.step_location(local, step)
        if local_final.exists(MANIFEST_FILE):
            return True
        if step in self._damaged:
            raise CorruptCheckpointError(
                f"step {step} of {remote} was proven damaged when it was first copied "
                f"down, and is never copied down again: {self._damaged.steps[step]}"
            )
        src = _steps.step_location(remote, step)
        with state.cond:
            state.reading.add(step)
        try:
            raw = src.read_bytes(MANIFEST_FILE)
            if raw is None:
                return False
            if state.owner is not None:  # the persistent path is still this run's
                state.owner.check(f"copying step {step} down from {remote}")
            # Our own dead remains there are cleared; a foreign entry raises, naming it.
            if _ownership.check_slot(local_final, what=f"step {step}", replace=False):
                _ownership.remove(local_final, action="clear the remains of a dead copy at")
            state.copied_down.append(step)
            try:
                nbytes, t0 = self._copy(step, src, raw, local_final)
            except ForeignEntryError:
                raise  # a planted link or FIFO: no damage of ours, nothing set aside
            except CorruptCheckpointError as e:
                with state.cond:
                    state.known.discard(step)
                if self._places.primary:  # one process sets a shared copy aside
                    self._damaged.set_aside(step, raw, e)
                raise
        finally:
            with state.cond:
                state.reading.discard(step)
        logger.warning(
            "checkpoint: copied step %d down from %s to %s: %d bytes, %.3f s",
            step,
            remote,
            local,
            nbytes,
            time.perf_counter() - t0,
        )
        return True

    def _copy(
        self, step: int, src: Location, raw: bytes, local_final: Location
    ) -> tuple[int, float]:
        """The copy into local staging, verified and committed; (bytes, start time)."""
        manifest = _files.parse_manifest(raw, src, step)
        files = [f for f in _files.remote_files(src) if f != MANIFEST_FILE]
        _files.check_listed(manifest, files, str(src))
        t0 = time.perf_counter()
        staging = Staging.begin(local_final, secrets.token_hex(6), own=self._places.per_host)
        try:
            limit = self._places.memory_limit()  # "auto": from the memory free now
            nbytes = _files.copy_files(
                src,
                staging.location,
                files,
                manifest,
                before_file=lambda: _env.fail_point("copy_down_file"),
                stopped=lambda: self._state.stop,
                memory_limit=limit,
            )
            _verify_copy(staging.location, raw, step, src, limit)
            marker = self._state.marker
            if self._places.per_host and marker is not None:  # this host's, with the step
                staging.location.write_bytes(HOST_FILE, marker(step), durable=False)
            staging.location.sync()
            staging.publish(MANIFEST_FILE, raw, replace=False)
        except BaseException:
            staging.abort()
            raise
        return nbytes, t0


def _error_class(outcome: str) -> type[CheckpointError]:
    """The error a shared outcome that failed is raised as elsewhere."""
    return CorruptCheckpointError if outcome.startswith("corrupt") else CheckpointError


def _verify_copy(
    staging: Location, raw: bytes, step: int, src: Location, limit: int | None
) -> None:
    """Verifies a step copied into local staging (its manifest written first) in full,
    under ``limit``; CorruptCheckpointError naming the persistent file on damage."""
    staging.write_bytes(MANIFEST_FILE, raw, durable=False)
    bad = [r for r in verify_step(staging, step, budget=window_bytes(limit)) if not r.ok]
    if bad:
        raise CorruptCheckpointError(
            f"step {step} of {src} failed verification after its copy down (nothing was "
            f"committed locally): " + "; ".join(f"{r.item or 'manifest'}: {r.error}" for r in bad)
        )
