"""Copy-down: a persistent step made a committed local one (see ``docs/tiers.md``),
verified in full in local staging first; only proven damage sets the persistent copy
aside. Training thread, on restore; collective with several processes.
:attr:`DamagedSteps.steps` is replaced, never mutated: readers see a whole dict.
"""

from __future__ import annotations

import hashlib
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
from ..._storage import local_files as _local_files
from ..._storage.location import Location
from . import files as _files
from .state import Places, TierState

logger = logging.getLogger("flax_orbax_plugin")

DAMAGED_FILE = "_DAMAGED.json"  # object stores: the record of the damaged steps


class DamagedSteps:
    """The damaged steps of one persistent location: ``steps``, ``{step: what failed}``."""

    def __init__(self, remote: Location):
        self.remote = remote
        self.steps: dict[int, str] = {}

    def committed_steps(self) -> list[int]:
        """Steps committed in the persistent tier now (listed), less the damaged ones."""
        damaged = self.steps
        return [s for s in _steps.committed_steps(self.remote) if s not in damaged]

    def read(self) -> dict[int, str]:
        """Primary, at open: the recorded damaged steps whose manifest is unchanged."""
        if self.remote.is_local:
            return {}
        raw = self.remote.read_bytes(DAMAGED_FILE)
        if raw is None:
            return {}
        where = f"{self.remote}/{DAMAGED_FILE}"
        try:
            doc = _local_files.parse(raw, where, _local_files.TIER_RECORD)
            steps = doc["steps"]
            if doc.get("library") != "flax_orbax_plugin" or not isinstance(steps, dict):
                raise ValueError("not a damage record of this library")
            out = {}
            for name, info in steps.items():
                if not _steps.is_step_name(name) or not isinstance(info, dict):
                    raise ValueError(f"field steps: entry {name!r} is no step record")
                sha = self._sha(name)
                if sha is not None and sha == info.get("manifest_sha256"):
                    out[int(name)] = str(info.get("error", ""))
            return out
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"{where}: expected this library's record of damaged steps, found {e}"
            ) from None

    def _write(self, damaged: dict[int, str], shas: dict[int, str]) -> None:
        doc = {
            "library": "flax_orbax_plugin",
            "kind": "damaged steps",
            "steps": {
                str(s): {"manifest_sha256": shas[s], "error": _text(damaged[s][:2000])}
                for s in sorted(damaged)
                if s in shas
            },
        }
        raw = _local_files.encode(
            doc, DAMAGED_FILE, _local_files.TIER_RECORD, sort_keys=True, separators=None
        )
        self.remote.write_bytes(DAMAGED_FILE, raw)

    def set_aside(self, step: int, raw: bytes, error: Exception) -> None:
        """Primary: ``step`` proven damaged, renamed aside or recorded (a failure: logged)."""
        text = str(error)
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
            self.steps = {**self.steps, step: text}
            shas = self._shas()
            shas[step] = hashlib.sha256(raw).hexdigest()
            self._write(self.steps, shas)
            logger.warning(
                "checkpoint: step %d of %s is damaged (%s); recorded in %s, never copied "
                "down again",
                step,
                self.remote,
                text,
                DAMAGED_FILE,
            )
        except Exception as e:  # noqa: BLE001  (the damage is what gets raised)
            self.steps = {**self.steps, step: text}  # this process skips it anyway
            logger.warning(
                "checkpoint: could not set step %d of %s aside: %s", step, self.remote, e
            )

    def _shas(self) -> dict[int, str]:
        return {s: sha for s in self.steps if (sha := self._sha(s)) is not None}

    def _sha(self, step: int | str) -> str | None:
        current = self.remote.child(str(step)).read_bytes(MANIFEST_FILE)
        return None if current is None else hashlib.sha256(current).hexdigest()

    def forget(self, step: int) -> None:
        """Replicator, after committing ``step``: a damaged copy it replaced is gone."""
        if step not in self.steps:
            return
        self.steps = {s: e for s, e in self.steps.items() if s != step}
        try:
            self._write(self.steps, self._shas())
        except Exception as e:  # noqa: BLE001  (the stale entry no longer matches anyway)
            logger.warning("checkpoint: could not update %s/%s: %s", self.remote, DAMAGED_FILE, e)


def _text(message: str) -> str:
    """An error message as text UTF-8 encodes (a lone surrogate escaped)."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


class CopyDown:
    """Copies persistent steps down into the local tier, for restore."""

    def __init__(self, places: Places, state: TierState, damaged: DamagedSteps):
        self._places = places
        self._state = state
        self._damaged = damaged

    def ensure_local(self, step: int, region: _distributed.Region) -> bool:
        """Training thread, on restore: makes ``step`` a committed local step (False when
        neither tier has it). Collective (in ``region``): the primary copies, shares the outcome."""
        if not self._places.multi:
            return self._ensure_local(step)
        if self._places.per_host:
            return self._each_ensure_local(step, region)
        outcome, error = self._outcome(step) if self._places.primary else ("absent", None)
        outcome = region.broadcast_str(region.next_operation_id("tiers-copy-down"), outcome)
        if outcome.startswith(("corrupt", "failed")):
            if self._places.primary:
                raise error
            raise _error_class(outcome)(
                f"copying step {step} down from {self._places.remote} failed on the primary: "
                + outcome.split(": ", 1)[1]
            )
        return outcome == "present"

    def _each_ensure_local(self, step: int, region: _distributed.Region) -> bool:
        """Each host's own directory: every process copies the step down; all succeed or raise."""
        outcome, error = self._outcome(step)
        op = region.next_operation_id("tiers-copy-down")
        region.publish(op, outcome)
        outcomes = region.gather_str(op)
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
        """Copies ``step`` down; only proven damage sets the persistent copy aside."""
        local, remote, state = self._places.local, self._places.remote, self._state
        local_final = _steps.step_location(local, step)
        if local_final.exists(MANIFEST_FILE):
            return True
        if step in self._damaged.steps:
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
            # verified in full (its manifest written first), under the memory limit
            staging.location.write_bytes(MANIFEST_FILE, raw, durable=False)
            budget = window_bytes(limit)
            bad = [r for r in verify_step(staging.location, step, budget=budget) if not r.ok]
            if bad:
                raise CorruptCheckpointError(
                    f"step {step} of {src} failed verification after its copy down (nothing "
                    f"was committed locally): "
                    + "; ".join(f"{r.item or 'manifest'}: {r.error}" for r in bad)
                )
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
