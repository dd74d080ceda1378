"""CPU priority of the library's bulk background threads (opt-in).

A save's background phase writes its chunks (checksums, writes, links) on a pool of
threads while the training steps run. At the same priority a pool of 8 such threads
takes a share of the CPUs per thread while they are runnable, which on a machine whose
training threads use every core slows the steps that overlap a save.
``FOP_BACKGROUND_NICE=<0-19>`` (checked by ``_base.env``: any other value is an
OptionError naming it) makes each such thread lower its own priority to that ``nice``
value as its first act (Linux nice values are per thread).

Confined to the library's own threads: a thread inherits the nice value of the thread
that creates it, and a lowered thread cannot raise itself back (that needs
CAP_SYS_NICE), so only a pool whose every task works on local files alone (OS calls,
checksums, links: :func:`initializer` with ``local_only=True``) lowers itself; a task
that may call a store's client (tensorstore's codecs and kvstores, HTTP), which starts
worker threads of its own that would keep the lowered value for the rest of the
process, runs at the process's priority. The commit protocol, retention, replication
and tier copies keep the process's priority. None of these threads runs user code.

Off by default (0): measured on a 2-core machine with a 1.2 GB state, nice 10 was
within the noise of nice 0 once the writes went through ``O_DIRECT`` (30 steps, 3
saves: 9.91 s against 10.23 s), while a lower priority lengthens the time a save is
in flight, the window in which a preemption loses it: at nice 19 a few-KiB save of a
Python-bound loop was not committed 100 steps later under load, and at nice 10 it
lost that race once in three runs of the end-to-end kill test.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from . import env as _env


def lower() -> None:
    """Lowers the calling thread's CPU priority to ``FOP_BACKGROUND_NICE`` (never
    raises an OSError; a no-op off Linux). Call only as the first act of a thread
    that starts no thread and calls no store's client (see the module docstring)."""
    nice = _env.read("FOP_BACKGROUND_NICE")
    if not nice or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        pass


def initializer(*, local_only: bool) -> Callable[[], None] | None:
    """The ``initializer`` of a bulk pool: :func:`lower` when every task of the pool
    works on local files alone (``local_only``), else None (the process's priority).
    Reads ``FOP_BACKGROUND_NICE`` now, so a bad value fails the save that makes the
    pool (raised by its ``wait``), before any thread is lowered."""
    _env.read("FOP_BACKGROUND_NICE")
    return lower if local_only else None
