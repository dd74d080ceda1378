"""Ctrl-C during a save: deferred over its blocking phase, re-raised at its end. Only
the main thread defers; blocks nest.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.interrupts``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Held:
    """The SIGINTs one deferral received so far (its handler while the block runs): a
    background phase started with one held starts cancelled (``SaveHandle.start``)."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum, frame) -> None:
        self.received.append(signum)


@contextlib.contextmanager
def deferred_sigint() -> Iterator[Held]:
    """The block with SIGINT recorded, then the previous handler back, run here if one came;
    yields the :class:`Held` (no deferral off the main thread or under a non-Python handler)."""
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
        if held.received:  # the previous handler runs now (a KeyboardInterrupt from here)
            signal.raise_signal(signal.SIGINT)
