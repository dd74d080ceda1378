"""The pending marker (``_PENDING.json``), and a save's ``SaveHandle`` and ``SaveResult``.

Marker functions are stateless, any thread; a handle's background phase runs on its own
(non-daemon) thread; ``wait``, ``done`` and ``cancel`` from any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.handle``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .._base import distributed as _distributed
from .._base import host as _host
from .._base.env import Option
from .._errors import CheckpointError, HookReentryError, SaveCancelledError
from .._format.layout import PENDING_FILE
from .._storage import local_files as _local_files
from .._storage.location import Location
from .._storage.store_errors import refusals

LIBRARY = "flax_orbax_plugin"
# The temporary file ``_storage.local_files.write_file`` writes a marker through.
TMP_RE = re.compile(rf"^{re.escape(PENDING_FILE)}\.tmp-[0-9a-f]{{1,64}}$", re.ASCII)


def marker_bytes(nonce: str, keep: list[str] | tuple[str, ...] = ()) -> bytes:
    """The pending marker: its writer (host, pid) and, for a removal, what it leaves."""
    doc = {"library": LIBRARY, "kind": "pending", "nonce": nonce}
    doc.update(host=socket.gethostname(), pid=os.getpid())
    if keep:
        doc["keep"] = list(keep)
    return json.dumps(doc).encode()


def is_marker(raw: bytes | None) -> bool:
    """True when ``raw`` is our pending marker (parsed within its limits)."""
    if raw is None:
        return False
    try:
        doc = _local_files.parse(raw, PENDING_FILE, _local_files.PENDING_MARKER)
    except CheckpointError:
        return False
    return isinstance(doc, dict) and doc.get("library") == LIBRARY and doc.get("kind") == "pending"


def keeps(raw: bytes | None) -> list[str]:
    """What a removal recorded in the pending marker ``raw`` that it leaves."""
    keep = json.loads(raw).get("keep") if is_marker(raw) else None
    return keep if isinstance(keep, list) and all(isinstance(k, str) for k in keep) else []


def temporary_files(loc: Location) -> list[str]:
    """Local only: the marker's temporary files in ``loc`` holding our marker or its start."""
    if not loc.is_local:
        return []
    try:
        kinds = loc.child_kinds()
    except OSError:
        return []
    names = sorted(n for n, kind in kinds.items() if kind == "file" and TMP_RE.match(n))
    return [n for n in names if _ours_cut_short(_read_quietly(loc, n))]


# How every pending marker begins (marker_bytes: json.dumps keeps the keys' order).
_HEAD = b'{"library": "flax_orbax_plugin", "kind": "pending", "nonce": "'


def _ours_cut_short(raw: bytes | None) -> bool:
    return raw is not None and (is_marker(raw) or _HEAD.startswith(raw) or raw.startswith(_HEAD))


def only_temporary_files(loc: Location) -> bool:
    """Local only: ``loc`` holds :func:`temporary_files` and nothing else."""
    try:
        kinds = loc.child_kinds() if loc.is_local else {}
    except OSError:
        return False
    return bool(kinds) and set(kinds) == set(temporary_files(loc))


def temporary_markers(loc: Location) -> list[str]:
    return [n for n in temporary_files(loc) if is_marker(_read_quietly(loc, n))]


def read(loc: Location) -> bytes | None:
    """The pending marker of ``loc``, else (local) a temporary file's; None when neither."""
    raw = loc.read_bytes(PENDING_FILE)
    if raw is not None:
        return raw
    found = temporary_markers(loc)
    return _read_quietly(loc, found[-1]) if found else None


def _read_quietly(loc: Location, name: str) -> bytes | None:
    try:
        return loc.read_bytes(name, max_bytes=_local_files.PENDING_MARKER.max_bytes)
    except (CheckpointError, OSError):
        return None  # a link, a FIFO, gone meanwhile: not our marker


_TIMEOUT = Option(  # SaveHandle.wait's (and every wait of the library that takes one)
    "timeout",
    "number",
    none_ok=True,
    low=0,
    expected="seconds, a finite number >= 0, or None (no limit)",
)
CANCELLED = "cancelled by its handle's cancel()"  # the reason of a cancel() without one


def checked_timeout(timeout: Any) -> float | None:
    """A wait's ``timeout`` checked, clamped to ``threading.TIMEOUT_MAX`` (no OverflowError)."""
    timeout = _TIMEOUT.check(timeout)
    return None if timeout is None else min(float(timeout), threading.TIMEOUT_MAX)


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """Figures of one finished save (a core checkpoint or a manager step), as seen by
    this process.

    ``blocking_seconds``: how long the caller waited; ``total_seconds``: from the start
    of the save until it committed; ``bytes_written``: array bytes this process wrote;
    ``bytes_reused``: array bytes of unchanged leaves hard-linked (local disk) or copied
    on the server (S3, GCS) from the previous step instead of written (incremental
    manager steps; not part of ``bytes_written``).
    """

    path: str
    blocking_seconds: float
    total_seconds: float
    bytes_written: int
    step: int | None = None
    bytes_reused: int = 0

    @property
    def gigabytes_per_second(self) -> float:
        return self.bytes_written / max(self.total_seconds, 1e-9) / 1e9

    def as_scalars(self) -> dict[str, float]:
        """For a metric writer: ``checkpoint/blocking_seconds`` and friends
        (``checkpoint/bytes_reused`` only when a step reused bytes)."""
        out = {
            "checkpoint/blocking_seconds": self.blocking_seconds,
            "checkpoint/total_seconds": self.total_seconds,
            "checkpoint/bytes": float(self.bytes_written),
            "checkpoint/gbytes_per_sec": self.gigabytes_per_second,
        }
        if self.bytes_reused:
            out["checkpoint/bytes_reused"] = float(self.bytes_reused)
        return out


class Cancellation(threading.Event):
    """A save's cancellation, with why (set once): no ``reason`` is an interruption."""

    def __init__(self) -> None:
        super().__init__()
        self.reason: str | None = None

    def cancel(self, reason: str | None) -> None:
        if not self.is_set():
            self.reason = reason
        self.set()


@_distributed.public(errors=refusals(lambda bound: [bound["self"].path]))
class SaveHandle:
    """A save whose background phase may still run: ``wait()`` returns its
    :class:`SaveResult` or re-raises its error (an error is never dropped: a handle
    nobody waited on raises at the next save).

    Thread-safety: ``wait``, ``done`` and ``cancel`` may be called from any thread. Made
    in a collective operation (``_base.regions``: its ``region``, which ``target`` is
    handed too), the background phase runs in that region: a failure there reaches
    the other processes at once, as one in the blocking phase. They wait on an event
    the background phase sets when it ends, never on ``Thread.join``: a join cut short
    by Ctrl-C marks the thread finished while it still runs (CPython 3.11), and the
    interpreter would then exit under a running save and leave its staging behind.
    """

    def __init__(
        self,
        path: str,
        target: Any,
        *,
        cancelled: Cancellation | None = None,
        region: _distributed.Region,
        guard: Callable[[str], None] | None = None,
    ):
        self.path = path
        self._guard = guard  # raises where a wait or cancel may not be made (on_event)
        self._target = target
        self._region = region
        self.cancelled = cancelled if cancelled is not None else Cancellation()
        self._thread = threading.Thread(target=self._run, name="fop-save", daemon=False)
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._finished = threading.Event()

    def start(self, *, held: Any = None) -> SaveHandle:
        """Starts the background phase (once). ``held``: the ``_base.interrupts.Held``
        of the deferral its blocking phase runs in; with a Ctrl-C held there, the
        background phase starts cancelled (an interruption), so the KeyboardInterrupt
        raised at that phase's end finds nothing committed, however soon the background
        phase would have finished."""
        if held is not None and held.received:
            self.cancelled.cancel(None)
        _RUNNING.add(self)  # a save nobody waits for still commits at exit
        _host.at_exit(_host.FINISH, _finish_running)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with self._region.resumed():
                self._result = self._target()
        except BaseException as e:  # noqa: BLE001  (re-raised on wait)
            e.add_note(f"raised by the background phase of the save to {self.path}")
            self._error = e
        finally:
            self._target = None  # drop the host snapshot
            self._finished.set()
            if self._error is None:
                _host.settled(self)  # nothing to report: a later read need not wait

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Blocks until the save is committed; raises its error if it failed (a save
        cancelled by :meth:`cancel`: its SaveCancelledError, each time).

        Interrupted (Ctrl-C, or any exception raised into the waiting thread), the save
        is abandoned (its background phase stops as interrupted), then the interruption
        propagates. ``timeout`` (seconds, a finite number >= 0, or None: no limit; one
        past ``threading.TIMEOUT_MAX`` waits that long) is checked first: a bad one is an
        OptionError and leaves the save running; a wait that times out raises
        TimeoutError and leaves it running too. Called from the save's own background
        thread (a callback it runs), or from where its ``guard`` refuses it (a manager's
        on_event hook): HookReentryError, never a wait for itself."""
        timeout = checked_timeout(timeout)
        self._refuse_reentry("SaveHandle.wait()")
        self._await(timeout)
        if self._error is not None:
            self._mark_reported()
            raise self._error
        assert self._result is not None
        return self._result

    def settle(self) -> SaveResult | None:
        """:meth:`wait` for a manager's save in flight (its ``wait``, its next save):
        the result, None for a save whose error was already reported (by a
        :meth:`wait`, or by :meth:`cancel`: a cancel is never reported again), else
        its error, raised (once)."""
        self._await(None)
        if self._error is not None:
            if self._reported:
                return None
            self._mark_reported()
            raise self._error
        return self._result

    def _await(self, timeout: float | None) -> None:
        try:
            finished = self._finished.wait(timeout)
        except BaseException:
            self.abandon()
            raise
        if not finished:
            raise TimeoutError(
                f"save to {self.path} still running after {timeout}s (it goes on: wait "
                f"again, or cancel() it)"
            )

    def _refuse_reentry(self, call: str) -> None:
        if threading.current_thread() is self._thread:
            raise HookReentryError(
                f"{call} was called on the background thread of the save to {self.path} "
                f"(from a callback that save runs): it would wait for itself; refused "
                f"rather than hang. Call it from the thread that started the save"
            )
        if self._guard is not None:
            self._guard(call)

    def cancel(self, *, reason: str | None = None) -> bool:
        """Abandons the save: its background phase stops before it commits (at its next
        check: before its first write, between the regions it writes, once its data is
        written, before the commit) and removes what it staged; waits for that. Returns
        True when nothing of the save was committed (cancelled, or failed), False when
        it committed first (it stays committed).

        The save ends with a :class:`SaveCancelledError` saying ``reason`` (e.g.
        ``"superseded by step 8"``; default: cancelled by this call; with several
        processes, every process then gets one: the commit's agreed outcome). That
        return is its report: its error (the cancellation, or one it met first) is
        never raised again by a manager (its ``wait``, ``close``, next ``save``); read
        it from :attr:`error`; :meth:`wait` on this handle raises it (no result).
        Interrupted again while it waits, the background phase still stops and cleans
        up on its own (the thread is not a daemon: the interpreter waits for it).
        Refused like :meth:`wait` from the save's own thread."""
        self._refuse_reentry("SaveHandle.cancel()")
        return self._cancel(CANCELLED if reason is None else str(reason))

    def abandon(self) -> bool:
        """:meth:`cancel` as an interruption: the background phase stops with a
        KeyboardInterrupt (what a Ctrl-C in the caller's wait, or at exit, does; a
        failing blocking phase after the background one started)."""
        return self._cancel(None)

    def _cancel(self, reason: str | None) -> bool:
        self.cancelled.cancel(reason)
        self._mark_reported()
        if self._thread.ident is None:
            return True  # never started: nothing was written
        if threading.current_thread() is not self._thread:
            self._finished.wait()
        return self._result is None

    @property
    def error(self) -> BaseException | None:
        """The error the background phase ended with (None while it runs or once it
        committed)."""
        return self._error if self._finished.is_set() else None

    def _mark_reported(self) -> None:
        self._reported = True
        _host.settled(self)

    def raise_unreported(self) -> None:
        """Waits; re-raises the error only if no ``wait()`` has reported it yet."""
        self._finished.wait()
        if self._error is not None and not self._reported:
            self._mark_reported()
            raise self._error


_RUNNING: weakref.WeakSet[SaveHandle] = weakref.WeakSet()


def _finish_running() -> bool:
    """The exit step: waits for the saves still running; True when one failed unreported."""
    # a Ctrl-C that ended the program is sys.last_value by now
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    failed = False
    for handle in [h for h in list(_RUNNING) if not h.done()]:
        if interrupted:
            handle.abandon()
            continue
        say = f"flax_orbax_plugin: the program ends: waiting for the save to {handle.path}"
        print(say, file=sys.stderr)
        handle._finished.wait()
        if handle._error is not None and not handle._reported:
            print(f"flax_orbax_plugin: that save failed: {handle._error!r}", file=sys.stderr)
            failed = True
    return failed


def raise_if_cancelled(cancelled: threading.Event | None, what: str) -> None:
    """Background phase: KeyboardInterrupt or SaveCancelledError once ``cancelled`` is set."""
    if cancelled is None or not cancelled.is_set():
        return
    where = f"process {_distributed.process_index()}"
    reason = getattr(cancelled, "reason", None)
    if reason is not None:
        raise SaveCancelledError(f"{what} cancelled on {where}: {reason}; nothing committed")
    raise KeyboardInterrupt(f"{what} cancelled: interrupted on {where}'s main thread")
