"""What a command run from a shell needs and an in-process call must not get: a stdout
whose reader may go away, and SIGTERM taken as an interruption.

``flax-orbax list DIR | head -1``: once the reader closes the pipe, the rest of the
output is dropped (stdout then points at ``/dev/null``) and the command finishes what it
was doing, with its own exit status (``gc``'s removals are done and reported as done,
``verify``'s damage still exits 1), as a pipe's writer that ignores SIGPIPE does. A
SIGTERM (a scheduler's, ``timeout``'s) interrupts the command as Ctrl-C does: what it
was writing is removed, and it exits 143. The standard library only; installed by
``main`` for a shell's command (``main()`` without ``argv``) alone.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Any

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
    """Ctrl-C and SIGTERM for a shell's command. Held back while the commands load
    (JAX's import, interrupted, fails as a raw ImportError or aborts the process), then
    raised where the command is (SIGTERM as :class:`Terminated`). One that Python
    swallowed (it arrived inside a garbage-collection callback, whose exceptions are
    ignored, and the command ran on) is still known: ``seen`` (``terminated`` for a
    SIGTERM)."""

    def __init__(self) -> None:
        self.seen = False
        self.terminated = False
        self._loading = True

    def handler(self, signum: int, frame: Any) -> None:
        self.seen = True
        if signum == signal.SIGTERM:
            self.terminated = True
        if not self._loading:
            self._raise()

    def _raise(self) -> None:
        if self.terminated:
            raise Terminated(f"terminated (signal {int(signal.SIGTERM)})")
        raise KeyboardInterrupt

    def loaded(self) -> None:
        """The commands are loaded: a signal held back is raised now, later ones at once."""
        self._loading = False
        if self.seen:
            self._raise()


def install(command: str) -> Interrupts:
    """A shell's command: stdout kept safe from a closed pipe, Ctrl-C and SIGTERM as
    :class:`Interrupts` says, the library's warnings as the command's lines
    (``flax-orbax list: warning: ...``, not Python's ``<file>:<line>: UserWarning``)."""
    sys.stdout = _PipeSafe(sys.stdout)  # type: ignore[assignment]

    def show(message: Any, category: Any, *_: Any, **__: Any) -> None:
        print(f"flax-orbax {command}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
    interrupts = Interrupts()
    signal.signal(signal.SIGINT, interrupts.handler)
    signal.signal(signal.SIGTERM, interrupts.handler)
    return interrupts
