"""The checkpoint event records: frozen dataclasses, one per kind of event, each with
the figures it gives a metric writer (``scalars``). Who sends them, on which thread and
in which order: ``events`` (the module docstring) and docs/manager.md, "Events"."""

from __future__ import annotations

import dataclasses

__all__ = [
    "Event",
    "RestoreDone",
    "SaveBlockingDone",
    "SaveCommitted",
    "SaveFailed",
    "SaveStarted",
    "StepReplicated",
    "StepsRemoved",
]


@dataclasses.dataclass(frozen=True)
class Event:
    """A checkpoint event of ``step`` in ``directory`` (the manager's)."""

    step: int
    directory: str

    def scalars(self) -> dict[str, float]:
        """The figures of this event for a metric writer (tag: value)."""
        return {}


@dataclasses.dataclass(frozen=True)
class SaveStarted(Event):
    """The policy decided to save ``step``; its blocking phase begins.

    ``host_memory``: the manager's host-memory ceiling for this save, in bytes (under
    ``host_memory="auto"`` the figure derived from the memory free now), None without
    one; ``streamed``: the save streams under it (writes from the state's own memory,
    each region copied to host as it is written) instead of copying the state first."""

    host_memory: int | None = None
    streamed: bool = False


@dataclasses.dataclass(frozen=True)
class SaveBlockingDone(Event):
    """The blocking phase of ``step`` ended: the training loop waited
    ``blocking_seconds``; the write and commit go on in the background.

    ``staging``: how accelerator arrays were copied (``device``: a copy on the device,
    brought to host in the background; ``host``: to host memory before returning, with
    the reason where it replaced ``device``; ``pinned``; ``streamed``; ``none`` where no
    array was on an accelerator)."""

    blocking_seconds: float
    staging: str = "none"

    def scalars(self) -> dict[str, float]:
        return {"checkpoint/save_blocking_seconds": self.blocking_seconds}


@dataclasses.dataclass(frozen=True)
class SaveCommitted(Event):
    """``step`` is committed in ``tier`` (``"local"``: the manager's directory).

    ``background_seconds``: from the end of the blocking phase to the commit;
    ``total_seconds``: from the start of the save. ``files_written`` and
    ``bytes_written``: the committed step's files as stored (see the module
    docstring; None where not counted); ``array_bytes``: array data written,
    ``bytes_reused``: array data linked or copied from the previous step instead
    (incremental)."""

    tier: str
    blocking_seconds: float
    background_seconds: float
    total_seconds: float
    files_written: int | None
    bytes_written: int | None
    array_bytes: int
    bytes_reused: int = 0

    @property
    def gigabytes_per_second(self) -> float:
        """Stored bytes (array bytes where not counted) per background second, in GB/s."""
        n = self.array_bytes if self.bytes_written is None else self.bytes_written
        return n / max(self.background_seconds, 1e-9) / 1e9

    def scalars(self) -> dict[str, float]:
        out = {
            "checkpoint/save_background_seconds": self.background_seconds,
            "checkpoint/save_total_seconds": self.total_seconds,
            "checkpoint/save_array_bytes": float(self.array_bytes),
            "checkpoint/save_gbytes_per_sec": self.gigabytes_per_second,
        }
        if self.bytes_written is not None:
            out["checkpoint/save_bytes"] = float(self.bytes_written)
        if self.files_written is not None:
            out["checkpoint/save_files"] = float(self.files_written)
        if self.bytes_reused:
            out["checkpoint/save_bytes_reused"] = float(self.bytes_reused)
        return out


@dataclasses.dataclass(frozen=True)
class SaveFailed(Event):
    """The save of ``step`` failed in its ``phase`` (``"blocking"`` or ``"background"``)
    with an exception of type ``error_type`` (its name) and ``message``; nothing of it
    was committed. The exception itself is raised by the manager as usual."""

    phase: str
    error_type: str
    message: str

    def scalars(self) -> dict[str, float]:
        return {"checkpoint/save_failed": 1.0}


@dataclasses.dataclass(frozen=True)
class RestoreDone(Event):
    """``step`` was restored from ``tier`` (``"local"``, or ``"persistent"``: copied
    down first) in ``seconds``. ``items``: the items read; ``files_read`` and
    ``bytes_read``: their files as stored (None where not counted)."""

    tier: str
    seconds: float
    items: tuple[str, ...]
    files_read: int | None
    bytes_read: int | None

    def scalars(self) -> dict[str, float]:
        out = {"checkpoint/restore_seconds": self.seconds}
        if self.bytes_read is not None:
            out["checkpoint/restore_bytes"] = float(self.bytes_read)
        return out


@dataclasses.dataclass(frozen=True)
class StepReplicated(Event):
    """``step`` is committed in the persistent tier (``directory``: its location), copied
    in ``seconds``; ``files_written``, ``bytes_written``: the committed copy as stored
    (as in SaveCommitted), ``bytes_copied``: what the copier read and sent."""

    seconds: float
    files_written: int | None
    bytes_written: int | None
    bytes_copied: int

    def scalars(self) -> dict[str, float]:
        return {
            "checkpoint/replicate_seconds": self.seconds,
            "checkpoint/replicate_bytes": float(self.bytes_copied),
        }


@dataclasses.dataclass(frozen=True)
class StepsRemoved(Event):
    """Retention removed ``removed`` (ascending) from ``tier``; ``step`` is the commit
    that ran it (None for ``gc()``)."""

    step: int | None
    tier: str
    removed: tuple[int, ...]

    def scalars(self) -> dict[str, float]:
        return {"checkpoint/steps_removed": float(len(self.removed))}
