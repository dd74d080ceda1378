"""Ctrl-C during a save: deferred over its blocking phase, re-raised at its end.

Only the main thread defers (elsewhere the block runs without deferral); blocks nest.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.interrupts``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Held:
    """The SIGINTs one deferral received so far (its handler while the block runs). A
    background phase started with a Ctrl-C held starts cancelled
    (``SaveHandle.start(held=)``), so it never races the KeyboardInterrupt."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum, frame) -> None:
        self.received.append(signum)


@contextlib.contextmanager
def deferred_sigint() -> Iterator[Held]:
    """Runs the block with SIGINT recorded; afterwards the previous handler is put back
    and, if a SIGINT arrived (several count as one), runs once, here. Yields the
    :class:`Held` (one that holds nothing off the main thread or under a handler
    installed outside Python: no deferral there)."""
    held = Held()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # installed outside Python: it could not be restored
        yield held
        return
    signal.signal(signal.SIGINT, held)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)
        if held.received:
            # The previous handler runs now (a KeyboardInterrupt propagates from here).
            signal.raise_signal(signal.SIGINT)
