"""What the library does when the program ends, in one order, from one exit hook.

Steps, in this order (each registered by the module that owns it, once, at first need):

1. :data:`FINISH` (``_core.handle``): the saves still running finish (or, after a
   Ctrl-C, are cancelled), so that every value they set for the other processes is set;
2. :data:`LEAVE` (``_manager.lifecycle``): the writers of several processes not closed
   leave their runs (the others, waiting for this one in their manager's next
   operation, raise at once, naming it and its error);
3. :data:`ANNOUNCE` (``_base.regions``): a process that took part in a collective
   operation says that its program ended (the others, waiting for it outside a
   manager, raise at once rather than at their stall timeout).

A step returns True when the program must exit with status 1 (a save that failed at
exit, which nobody else reads): then, once every step ran, the program's own ``atexit``
handlers run and the process exits with 1. Every step runs, whatever an earlier one
found (a failed save still lets the others learn that this process left).

One ``threading`` exit hook: those run before ``atexit``'s (jax's shutdown barrier
among them, which would wait for the others), last registered first; ours is
registered after ``concurrent.futures``' own (imported here for that), so a save still
running writes with pools not yet shut down. A process that never used the library
with several processes registers no step that touches jax.

Threading: :func:`at_exit` from any thread; the steps run on the main thread at exit.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook first: ours runs before it)
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable

__all__ = ["ANNOUNCE", "FINISH", "LEAVE", "at_exit"]

FINISH, LEAVE, ANNOUNCE = 0, 1, 2  # the steps, in the order they run
_STEPS: dict[int, Callable[[], bool]] = {}  # step -> its work (see the module docstring)
_LOCK = threading.Lock()
logger = logging.getLogger("flax_orbax_plugin")


def at_exit(step: int, work: Callable[[], bool]) -> None:
    """Runs ``work`` as ``step`` when the program ends (once, whatever the number of
    calls; the first registers the exit hook). ``work`` returns True when the program
    must exit with status 1."""
    with _LOCK:
        if not _STEPS:
            threading._register_atexit(_run)  # type: ignore[attr-defined]
        _STEPS.setdefault(step, work)


def _run() -> None:
    failed = False
    for step in sorted(_STEPS):
        try:
            failed = bool(_STEPS[step]()) or failed
        except Exception:  # the program is ending: said, then the next step
            logger.exception("flax_orbax_plugin: a step at exit failed")
    if failed:  # a lost step is not a success: the exit status says so (1)
        print("flax_orbax_plugin: exit status 1 (a save failed at exit)", file=sys.stderr)
        atexit._run_exitfuncs()  # the program's own exit handlers still run, then
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)
