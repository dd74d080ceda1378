"""A shell's command (``main()`` without ``argv``): a stdout whose reader may go away,
SIGTERM taken as an interruption.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin.cli.shell``.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Any

EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is (its cleanups run as for Ctrl-C)."""


class _PipeSafe:
    """``stream`` whose writes, once its reader has gone (EPIPE), go nowhere."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.broken = True
        devnull = os.open(os.devnull, os.O_WRONLY)  # the buffered rest, flushed at exit
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Interrupts:
    """Ctrl-C and SIGTERM for a shell's command: one line, and 130 or 143. Held back while
    the commands load (an interrupted JAX import aborts), then raised where the command
    is; during an interruption's clean-up only noted; after :meth:`finish`, too late.

    Main thread; call order: :meth:`loaded`, then :meth:`stopped` or :meth:`finish`.
    """

    def __init__(self) -> None:
        self.command = ""
        self.signum: int | None = None  # the first signal: the one the command reports
        self._state = "loading"  # then "running", and "stopped" or "finished"

    def handler(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if self._state == "finished":
            self._exit_too_late()
        elif self._state == "running" and not _handling_interruption():
            _raise(signum)

    def loaded(self) -> None:
        """The commands are loaded: a signal held back is raised now, later ones at once."""
        self._state = "running"
        if self.signum is not None:
            _raise(self.signum)

    def stopped(self) -> None:
        """Later signals ignored (after finalization a default handler would kill us)."""
        self._state = "stopped"
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def finish(self, status: int) -> int:
        """``status``, or 130 / 143 where a signal came too late to stop the command."""
        if self._state == "stopped":
            return status
        self._state = "finished"
        return status if self.signum is None else self._too_late()

    def _too_late(self) -> int:
        """Stops (:meth:`stopped`), says the signal came too late; its exit status."""
        self.stopped()
        terminated = self.signum == signal.SIGTERM
        what = "terminated" if terminated else "interrupted"
        print(
            f"flax-orbax {self.command}: {what}, too late to stop it: the command had "
            f"finished (what it wrote is complete)",
            file=sys.stderr,
        )
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED

    def _exit_too_late(self) -> None:
        code = self._too_late()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)  # the work is done and its output flushed: nothing left to run


def _raise(signum: int) -> None:
    if signum == signal.SIGTERM:
        raise Terminated(f"terminated (signal {int(signal.SIGTERM)})")
    raise KeyboardInterrupt


def _handling_interruption() -> bool:
    """True while the main thread handles a KeyboardInterrupt: a clean-up under way."""
    exc = sys.exc_info()[1]
    for _ in range(64):  # an exception raised during the clean-up: its context
        if exc is None:
            return False
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


def open_standard_streams() -> None:
    """Descriptors 0, 1, 2 the shell left closed (``>&-``) opened on ``/dev/null``: else a
    log line went into the first file the command opened."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    # on a /dev/null of their own: descriptors 1 and 2 may hold another file
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def install_signals() -> Interrupts:
    """Ctrl-C and SIGTERM as :class:`Interrupts` says; one ignored at start (``cmd &``) stays so."""
    interrupts = Interrupts()
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, interrupts.handler)
    return interrupts


def install(interrupts: Interrupts, command: str) -> None:
    """Once parsed: stdout safe from a closed pipe, warnings as the command's lines."""
    interrupts.command = command
    sys.stdout = _PipeSafe(sys.stdout)  # type: ignore[assignment]

    def show(message: Any, category: Any, *_: Any, **__: Any) -> None:
        print(f"flax-orbax {command}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
