"""Handles and results of a save: a :class:`SaveHandle` for the background phase, a
:class:`SaveResult` for what it did.

Threading: a handle's background phase runs on its own (non-daemon) thread; ``wait``,
``done`` and ``cancel`` may be called from any thread.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from .._base import distributed as _distributed
from .._storage.store_errors import raises_store_errors_in_methods


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


@raises_store_errors_in_methods(lambda bound: [bound["self"].path])
class SaveHandle:
    """A save whose background phase may still run: ``wait()`` returns its
    :class:`SaveResult` or re-raises its error (an error is never dropped: a handle
    nobody waited on raises at the next save).

    Thread-safety: ``wait``, ``done`` and ``cancel`` may be called from any thread. Made
    in a collective operation (``_base.regions``), the background phase runs in its
    region: a failure there reaches the other processes at once, as one in the blocking
    phase. They wait on an event the background phase sets when it ends, never on
    ``Thread.join``: a join cut short by Ctrl-C marks the thread finished while it still
    runs (CPython 3.11), and the interpreter would then exit under a running save and
    leave its staging behind.
    """

    def __init__(self, path: str, target: Any, *, cancelled: threading.Event | None = None):
        self.path = path
        self._target = target
        self._region = _distributed.current_region()
        # Set by :meth:`cancel`; the background phase checks it (see raise_if_cancelled).
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self._thread = threading.Thread(target=self._run, name="fop-save", daemon=False)
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._finished = threading.Event()

    def start(self) -> SaveHandle:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with _distributed.resumed(self._region):
                self._result = self._target()
        except BaseException as e:  # noqa: BLE001  (re-raised on wait)
            e.add_note(f"raised by the background phase of the save to {self.path}")
            self._error = e
        finally:
            self._target = None  # drop the host snapshot
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Blocks until the save is committed; raises its error if it failed.

        Interrupted (Ctrl-C, or any exception raised into the waiting thread), the save
        is abandoned: :meth:`cancel`, then the interruption propagates."""
        try:
            finished = self._finished.wait(timeout)
        except BaseException:
            self.cancel()
            raise
        if not finished:
            raise TimeoutError(f"save to {self.path} still running after {timeout}s")
        if self._error is not None:
            self._reported = True
            raise self._error
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        """Abandons the save: its background phase stops before it commits (at its next
        check: before its first write, once its data is written, before the commit) and
        removes what it staged; waits for that. Its error (the cancellation, or one it
        met first) is not reported again. A save that committed first stays committed.

        Interrupted again while it waits, the background phase still stops and cleans
        up on its own (the thread is not a daemon: the interpreter waits for it)."""
        self.cancelled.set()
        self._reported = True
        if self._thread.ident is not None:
            self._finished.wait()

    def raise_unreported(self) -> None:
        """Waits; re-raises the error only if no ``wait()`` has reported it yet."""
        self._finished.wait()
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error


def raise_if_cancelled(cancelled: threading.Event, what: str) -> None:
    """Background phase, at its checks: stops a save whose handle was cancelled (a
    KeyboardInterrupt on the caller's thread); the commit protocol then removes what was
    staged and tells every other process."""
    if cancelled.is_set():
        where = f"process {_distributed.process_index()}"
        raise KeyboardInterrupt(f"{what} cancelled: interrupted on {where}'s main thread")
