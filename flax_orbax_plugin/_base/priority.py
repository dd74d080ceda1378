"""CPU priority of the library's bulk background threads: below the training loop's.

A save's background phase writes its chunks (checksums, writes, links, copies) on a
pool of threads while the training steps run. At the same priority a pool of 8 such
threads takes a share of the CPUs per thread: on a 2-core machine they left the 2
threads of a jitted step a fifth of the CPU while they were runnable. Each bulk thread
therefore lowers its own priority (``nice`` 10 on Linux, where nice values are per
thread; a tenth of a normal thread's share under contention) as its first act.

Only the bulk pools do (the chunk writers, links and server-side copies, the
persistent tier's file copies): the threads that run a save's commit protocol,
retention and replication keep the process's priority. A lower priority there was
measured to starve them, and with them the main thread at the GIL: at nice 19 a save
of a few KiB did not commit within 100 steps of a Python-bound loop, and a 1.2 GB save
was not done 10 steps later, so the loop waited for it at the next save.

``FOP_BACKGROUND_NICE`` (an integer 0-19; default 10) sets the value; 0 leaves the
threads at the process's priority. None of these threads ever runs user code.
"""

from __future__ import annotations

import os
import threading

_DEFAULT = 10


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
