"""Persistent steps a verified copy-down proved damaged (see ``docs/tiers.md``).

Renamed ``<step>.corrupt-<nonce>`` on filesystems, recorded in :data:`DAMAGED_FILE`
(with the damaged manifest's sha256) on object stores: never listed, copied down or
counted again. The primary reads the record at open, sets steps aside (training
thread) and forgets them (replicator thread); :attr:`DamagedSteps.steps` is replaced,
never mutated, so readers on other threads see a whole dict.
"""

from __future__ import annotations

import hashlib
import logging
import secrets

from ..._errors import CorruptCheckpointError
from ..._format import steps as _steps
from ..._format.layout import MANIFEST_FILE
from ..._storage import local_files as _local_files
from ..._storage.location import Location

__all__ = ["DAMAGED_FILE", "DamagedSteps"]

logger = logging.getLogger("flax_orbax_plugin")

# Object stores: the persistent steps a verified copy-down proved damaged (they cannot
# be renamed aside), with the sha256 of the manifest found damaged.
DAMAGED_FILE = "_DAMAGED.json"


class DamagedSteps:
    """The damaged steps of one persistent location: ``steps``, ``{step: what failed}``."""

    def __init__(self, remote: Location):
        self.remote = remote
        self.steps: dict[int, str] = {}

    def __contains__(self, step: int) -> bool:
        return step in self.steps

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
        """Primary, after a verified copy-down proved ``step`` damaged: renamed aside, or
        recorded (object stores); a failure to do so is logged (the damage is raised)."""
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
        out = {}
        for s in self.steps:
            current = self.remote.child(str(s)).read_bytes(MANIFEST_FILE)
            if current is not None:
                out[s] = hashlib.sha256(current).hexdigest()
        return out

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
