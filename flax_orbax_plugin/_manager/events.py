"""The checkpoint event records (handed to ``on_event=`` and ``jax.monitoring``). The hook
is never called by two threads at once; which thread sends each event: the design notes.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.events``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import jax.monitoring

from .._base import distributed as _distributed
from .._errors import EventHookError, HookReentryError
from .._storage.local_files import walk_entries
from .._storage.location import Location


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


logger = logging.getLogger("flax_orbax_plugin")

_P = "/flax_orbax_plugin"
MONITORING_NAMES: Mapping[str, str] = {
    "save_started": f"{_P}/save/started",
    "save_blocking_secs": f"{_P}/save/blocking_duration_secs",
    "save_committed": f"{_P}/save/committed",
    "save_background_secs": f"{_P}/save/background_duration_secs",
    "save_bytes": f"{_P}/save/bytes_written",
    "save_files": f"{_P}/save/files_written",
    "save_failed": f"{_P}/save/failed",
    "restore_secs": f"{_P}/restore/duration_secs",
    "restore_bytes": f"{_P}/restore/bytes_read",
    "step_removed": f"{_P}/retention/step_removed",
    "replicate_secs": f"{_P}/replicate/duration_secs",
    "replicate_bytes": f"{_P}/replicate/bytes_copied",
}
"""The ``jax.monitoring`` names this package records (each with ``step=``)."""


def stored_size(location: Location, dirs: Iterable[str] = ("",)) -> tuple[int, int | None]:
    """``(files, bytes)`` stored under ``dirs`` of ``location`` (bytes None on object stores)."""
    files, size = 0, 0
    for d in dirs:
        where = location.child(d) if d else location
        if not where.is_local:
            files += len(where.keys())
            size = None
            continue
        for entry in walk_entries(where.path.rstrip("/") or "/"):
            if entry.is_file(follow_symlinks=False):
                files += 1
                if size is not None:
                    size += entry.stat(follow_symlinks=False).st_size
    return files, size


def measure_stored(
    location: Location, dirs: Iterable[str] = ("",)
) -> tuple[int, int | None] | None:
    """:func:`stored_size`, or None (logged): a count never fails what it describes."""
    try:
        return stored_size(location, dirs)
    except Exception as e:  # noqa: BLE001  (the figures are left out, said so)
        logger.warning("checkpoint: cannot count the files of %s: %s", location, e)
        return None


class ScalarWriter(Protocol):
    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...


class MetricWriterEvents:
    """An ``on_event`` hook writing each event's figures to a metric writer (CLU's
    ``MetricWriter.write_scalars(step, scalars)``: ``SummaryWriter`` for TensorBoard),
    at the event's step, so they appear beside the loss. Tags: ``checkpoint/...``
    (``Event.scalars``); an event without figures (SaveStarted) writes nothing.

    Threading: ``write_scalars`` is called on the thread the event comes from (the
    save's background thread for SaveCommitted); CLU's ``SummaryWriter`` may be written
    from several threads. For a writer that may not, give the events to a queue and
    write them from the training loop."""

    def __init__(self, writer: ScalarWriter):
        if not callable(getattr(writer, "write_scalars", None)):
            raise TypeError(
                f"MetricWriterEvents: expected a writer with write_scalars(step, scalars), "
                f"found {type(writer).__name__}"
            )
        self.writer = writer

    def __call__(self, event: Event) -> None:
        scalars = event.scalars()
        step = event.step if event.step is not None else max(getattr(event, "removed", [0]))
        if scalars:
            self.writer.write_scalars(int(step), scalars)


class Events:
    """Delivers a manager's events to ``jax.monitoring``, then to ``hook`` (or None);
    from the training, save and deletion threads, one call at a time."""

    def __init__(self, hook: Callable[[Event], Any] | None = None):
        self.hook = hook
        self._lock = threading.RLock()
        self._error: EventHookError | None = None  # the first not raised yet
        # (thread id, event) of each hook call running, innermost last (under _lock).
        self._delivering: list[tuple[int, Event]] = []

    def delivering(self) -> Event | None:
        """The event whose hook the calling thread is in (innermost), or None."""
        me = threading.get_ident()
        for ident, event in reversed(list(self._delivering)):
            if ident == me:
                return event
        return None

    def refuse_in_hook(self, call: str) -> None:
        """HookReentryError when the calling thread is in the hook (``call`` would wait on it)."""
        event = self.delivering()
        if event is None:
            return
        on = threading.current_thread().name
        raise HookReentryError(
            f"{call} was called from the on_event hook while it handled {type(event).__name__} "
            f"of step {event.step} (thread {on!r}): it would wait for the hook itself; refused "
            f"rather than hang. Note the event in the hook and call {call} from the training "
            f"loop (steps(), latest_step() and, with one process, restore() may be called there)"
        )

    def emit(self, event: Event) -> None:
        """Records ``event`` and calls the hook; what it raises is logged and kept."""
        with self._lock:
            try:
                _monitor(event)
                if self.hook is not None:
                    self._delivering.append((threading.get_ident(), event))
                    try:
                        self.hook(event)
                    finally:
                        self._delivering.pop()
            except BaseException as e:  # kept, raised by raise_error
                main = threading.current_thread() is threading.main_thread()
                if isinstance(e, KeyboardInterrupt) and main:
                    raise  # the user's Ctrl-C, on the training thread: at once
                logger.error(
                    "checkpoint: the on_event hook raised %s on %s (pid %d, thread %s); "
                    "raised again by the next save() that saves, wait() or close()",
                    type(e).__name__,
                    event,
                    os.getpid(),
                    threading.current_thread().name,
                    exc_info=True,
                )
                if self._error is None:
                    self._error = EventHookError(
                        f"the on_event hook raised {type(e).__name__}: {e} on "
                        f"{type(event).__name__} of step {event.step} in {event.directory} "
                        f"(the checkpoint is unaffected: fix the hook)"
                    )
                    self._error.event = event
                    self._error.__cause__ = e

    def holding(self, fn: Callable[[], Any]) -> None:
        """``fn()``; an EventHookError it raises is kept for :meth:`raise_error`."""
        try:
            fn()
        except EventHookError as e:
            with self._lock:
                self._error = self._error or e

    def _take(self) -> EventHookError | None:
        with self._lock:
            kept, self._error = self._error, None
        return kept

    def raise_error(self) -> None:
        """Training thread: raises the first hook error not yet raised (once)."""
        kept = self._take()
        if kept is not None:
            raise kept

    def raise_after_save(self, step: int) -> None:
        """With one process, :meth:`raise_error` as a save of ``step`` returns."""
        kept = self._take() if _distributed.process_count() == 1 else None
        if kept is not None:
            kept.saved_step = step
            raise kept

    def agree(self, kind: str, region: _distributed.Region, *, what: str) -> None:
        """Collective (a barrier in ``region``): any process's hook error raised on all."""
        region.agree(kind, self._take(), what=what)

    def save_failed(self, step: int, directory: str, phase: str, error: BaseException) -> None:
        self.emit(SaveFailed(step, directory, phase, type(error).__name__, str(error)))

    def steps_removed(
        self, step: int | None, directory: str, removed: list[int], tier: str = "local"
    ) -> None:
        if removed:
            self.emit(StepsRemoved(step, directory, tier, tuple(sorted(removed))))


class HookGuarded:
    """A base of the manager: its calls that wait for its own threads (``restore`` too, with
    several processes), called from its on_event hook, raise HookReentryError first."""

    _REFUSED = ("save", "step_parts", "wait", "wait_for_save", "delete", "gc", "close", "leave")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in (*cls._REFUSED, "restore"):
            alone_ok = name == "restore"
            setattr(cls, name, _guarded(getattr(cls, name), f"manager.{name}()", alone_ok))


def _guarded(method: Callable, call: str, alone_ok: bool) -> Callable:
    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not (alone_ok and _distributed.process_count() == 1):
            self._book.events.refuse_in_hook(call)
        return method(self, *args, **kwargs)

    return guarded


def _monitor(event: Event) -> None:
    n, duration = MONITORING_NAMES, jax.monitoring.record_event_duration_secs
    if isinstance(event, StepsRemoved):
        for s in event.removed:
            jax.monitoring.record_event(n["step_removed"], step=s)
        return
    step = int(event.step)
    if isinstance(event, SaveStarted):
        jax.monitoring.record_event(n["save_started"], step=step)
    elif isinstance(event, SaveBlockingDone):
        duration(n["save_blocking_secs"], event.blocking_seconds, step=step)
    elif isinstance(event, SaveCommitted):
        jax.monitoring.record_event(n["save_committed"], step=step)
        duration(n["save_background_secs"], event.background_seconds, step=step)
        if event.bytes_written is not None:
            jax.monitoring.record_scalar(n["save_bytes"], event.bytes_written, step=step)
        if event.files_written is not None:
            jax.monitoring.record_scalar(n["save_files"], event.files_written, step=step)
    elif isinstance(event, SaveFailed):
        jax.monitoring.record_event(n["save_failed"], step=step)
    elif isinstance(event, StepReplicated):
        duration(n["replicate_secs"], event.seconds, step=step)
        jax.monitoring.record_scalar(n["replicate_bytes"], event.bytes_copied, step=step)
    elif isinstance(event, RestoreDone):
        duration(n["restore_secs"], event.seconds, step=step)
        if event.bytes_read is not None:
            jax.monitoring.record_scalar(n["restore_bytes"], event.bytes_read, step=step)
