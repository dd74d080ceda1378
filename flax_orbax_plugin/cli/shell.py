"""What a command run from a shell needs: a stdout whose reader may go away, and SIGTERM
taken as an interruption.

Installed by ``main`` for a shell's command (``main()`` without ``argv``) alone.

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
    """Ctrl-C and SIGTERM for a shell's command: one line, and 130 (SIGINT) or 143
    (SIGTERM), whenever they come and however many.

    Held back while the commands load (JAX's import, interrupted, fails as a raw
    ImportError or aborts the process), then raised where the command is (SIGTERM as
    :class:`Terminated`). One that arrives while an interruption is already being
    handled (the command cleaning up what it was writing, ``main`` saying so) is noted,
    not raised: it would cut the clean-up short or escape as a traceback. One that Python
    swallowed (it arrived inside a garbage-collection callback, whose exceptions are
    ignored, and the command ran on) is still known: ``signum``. Once the command has its
    status (:meth:`finish`), a signal says it came too late and exits at once.

    Main thread (signal handlers run there); call order: :meth:`loaded`, then
    :meth:`stopped` (main reported an interruption) or :meth:`finish`.
    """

    def __init__(self, command: str = "") -> None:
        self.command = command
        self.signum: int | None = None  # the first signal: the one the command reports
        self._state = "loading"  # then "running", and "stopped" or "finished"

    @property
    def terminated(self) -> bool:
        return self.signum == signal.SIGTERM

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
        """``main`` has said how the command ended: later signals change nothing, until
        the process has exited (ignored, not handled: once Python's finalization has
        put the default handlers back, one would kill the process)."""
        self._state = "stopped"
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def finish(self, status: int) -> int:
        """The command ended with ``status``: the exit status, 130 or 143 where a signal
        came that could not stop it (said so on stderr); a later one exits at once."""
        if self._state == "stopped":
            return status
        self._state = "finished"
        if self.signum is None:
            return status
        self.stopped()
        return self._say_too_late()

    def _say_too_late(self) -> int:
        what = "terminated" if self.terminated else "interrupted"
        print(
            f"flax-orbax {self.command}: {what}, too late to stop it: the command had "
            f"finished (what it wrote is complete)",
            file=sys.stderr,
        )
        return EXIT_TERMINATED if self.terminated else EXIT_INTERRUPTED

    def _exit_too_late(self) -> None:
        self.stopped()
        code = self._say_too_late()
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
    """True while the main thread handles a KeyboardInterrupt (an ``except`` or
    ``finally`` block, a context manager's exit, on its way out): a clean-up under way."""
    exc = sys.exc_info()[1]
    for _ in range(64):  # an exception raised during the clean-up: its context
        if exc is None:
            return False
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


def open_standard_streams() -> None:
    """A descriptor 0, 1 or 2 the shell left closed (``>&-``, ``2>&-``, a daemon's) is
    opened on ``/dev/null``, and Python's stream for it (None then) is made on it: the
    command's lines go nowhere, as to a reader that closed the pipe. Else stdout was
    None (an AttributeError, a traceback and exit status 120), stderr's lines went to
    stdout (into a ``--json`` document), and the first file the command opened took the
    free number, where a library's log line to descriptor 2 would have landed."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    # For the process's life; on a /dev/null of their own, not on descriptors 1 and 2,
    # which a file opened before this (whose stream this is not) may hold.
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def install_signals() -> Interrupts:
    """Ctrl-C and SIGTERM as :class:`Interrupts` says: the first thing a shell's command
    does (before its arguments are parsed), so that none is raw at any moment. A signal
    the command was started ignoring stays ignored, as Python and other tools leave it
    (a script's background job, ``cmd &``, ignores SIGINT: the Ctrl-C that stops the
    script is not for it)."""
    interrupts = Interrupts()
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, interrupts.handler)
    return interrupts


def install(interrupts: Interrupts, command: str) -> None:
    """A shell's command, once parsed: stdout kept safe from a closed pipe, the
    library's warnings as the command's lines (``flax-orbax list: warning: ...``, not
    Python's ``<file>:<line>: UserWarning``), ``command`` named by :class:`Interrupts`."""
    interrupts.command = command
    sys.stdout = _PipeSafe(sys.stdout)  # type: ignore[assignment]

    def show(message: Any, category: Any, *_: Any, **__: Any) -> None:
        print(f"flax-orbax {command}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
