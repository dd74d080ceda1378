"""Ctrl-C during a save: deferred over its blocking phase, re-raised at its end.

Only the main thread defers (elsewhere the block runs without deferral); blocks nest.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.interrupts``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["deferred_sigint"]


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Runs the block with SIGINT recorded rather than acted on; afterwards the
    previous handler is put back exactly and, if a SIGINT arrived, runs once, here
    (so ``KeyboardInterrupt`` is raised at the end of the block, after the block's own
    clean-up). Several SIGINTs during the block count as one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:  # installed outside Python: it could not be restored
        yield
        return
    received: list[int] = []

    def record(signum, frame) -> None:
        received.append(signum)

    signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            # Delivered again to this thread: the previous handler runs now, as if the
            # signal had just arrived (a KeyboardInterrupt propagates from here).
            signal.raise_signal(signal.SIGINT)
