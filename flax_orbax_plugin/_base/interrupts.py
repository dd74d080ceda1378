"""Ctrl-C during a save: deferred over its blocking phase, re-raised at its end.

Only the main thread defers (elsewhere the block runs without deferral); blocks nest.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.interrupts``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Held", "deferred_sigint"]


class Held:
    """What one deferral holds: the SIGINTs its block received so far (``received``;
    raised as one at its end). Its handler while the block runs. A background phase
    started inside the block reads it (``SaveHandle.start(held=)``): started with a
    Ctrl-C held, it starts cancelled, so the KeyboardInterrupt at the block's end never
    races its commit."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum, frame) -> None:
        self.received.append(signum)


@contextlib.contextmanager
def deferred_sigint() -> Iterator[Held]:
    """Runs the block with SIGINT recorded rather than acted on; afterwards the
    previous handler is put back exactly and, if a SIGINT arrived, runs once, here
    (so ``KeyboardInterrupt`` is raised at the end of the block, after the block's own
    clean-up). Several SIGINTs during the block count as one. Yields the block's
    :class:`Held` (off the main thread, or under a handler installed outside Python,
    one that holds nothing: the signal is not deferred there)."""
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
            # Delivered again to this thread: the previous handler runs now, as if the
            # signal had just arrived (a KeyboardInterrupt propagates from here).
            signal.raise_signal(signal.SIGINT)
