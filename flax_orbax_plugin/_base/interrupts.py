"""Ctrl-C during a save: deferred over its blocking phase, re-raised at its end.

A SIGINT that arrives while a save copies the state to host would otherwise raise
``KeyboardInterrupt`` wherever the main thread happens to be, including inside a
callback run by JAX or tensorstore, which report and drop it: the training loop ran
on. :func:`deferred_sigint` holds it instead and hands it, once the block is over,
to the handler that was installed before (``KeyboardInterrupt`` by default).

Threading: only the main thread may install a signal handler; on any other thread
(and where the previous handler was not installed from Python, so it could not be put
back exactly) the block runs without deferral. Nesting is fine: an inner block hands
the signal to the outer one's recorder, which re-raises it at its own end.
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
