"""CPU priority of the library's background threads: below the training loop's.

A save's background phase (checksums, copies into the page cache, writeback, fsync)
runs on threads of its own while the training steps run. At the same priority, a
pool of writer threads takes a share of the CPUs per thread: on a 2-core machine,
8 writers left the 2 threads of a jitted step a fifth of the CPU and the step after a
save ran 4-5x slower. Each background thread therefore lowers its own priority
(``nice`` 19 on Linux, where nice values are per thread) as its first act: it then
runs in the gaps the training threads leave and at full speed whenever the loop
waits (for a save, a restore, the final wait, a SIGTERM step).

``FOP_BACKGROUND_NICE`` (an integer 0-19; default 19) sets the value; 0 leaves the
threads at the process's priority. Only threads the library creates for one save or
restore call :func:`lower` (the save's thread and chunk writers, links, retention,
the persistent tier's replication and copies): none of them ever runs user code.
"""

from __future__ import annotations

import os
import threading

_DEFAULT = 19


def _nice() -> int:
    try:
        return max(0, min(19, int(os.environ.get("FOP_BACKGROUND_NICE", _DEFAULT))))
    except ValueError:
        return _DEFAULT


def lower() -> None:
    """Lowers the calling thread's CPU priority (never raises; a no-op off Linux)."""
    nice = _nice()
    if not nice or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        pass


def in_background(fn):
    """``fn`` run after :func:`lower` (a thread's target)."""

    def run(*args, **kwargs):
        lower()
        return fn(*args, **kwargs)

    return run
