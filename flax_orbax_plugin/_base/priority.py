"""CPU priority of the library's bulk background threads (opt-in).

A save's background phase writes its chunks (checksums, writes, links, copies) on a
pool of threads while the training steps run. At the same priority a pool of 8 such
threads takes a share of the CPUs per thread while they are runnable, which on a
machine whose training threads use every core slows the steps that overlap a save.
``FOP_BACKGROUND_NICE=<1-19>`` makes each bulk thread lower its own priority to that
``nice`` value as its first act (Linux nice values are per thread).

Off by default (0): measured on a 2-core machine with a 1.2 GB state, nice 10 was
within the noise of nice 0 once the writes went through ``O_DIRECT`` (30 steps, 3
saves: 9.91 s against 10.23 s), while a lower priority lengthens the time a save is
in flight, the window in which a preemption loses it: at nice 19 a few-KiB save of a
Python-bound loop was not committed 100 steps later under load, and at nice 10 it
lost that race once in three runs of the end-to-end kill test. Only the bulk pools
ever lower themselves (chunk writers, links, server-side and tier file copies); the
commit protocol, retention and replication keep the process's priority. None of
these threads runs user code.
"""

from __future__ import annotations

import os
import threading

_DEFAULT = 0


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
