"""The ``FOP_*`` environment variables the package reads, each declared once.

:func:`read` is the one place a ``FOP_*`` variable is read: its text is parsed and
checked against its declaration (:class:`~._base.option_spec.Option`), and a value it
does not take raises :class:`~flax_orbax_plugin.OptionError` naming the variable,
what it takes and what was found (never clamped, never ignored). Unset or empty: the
default. Read at each use (the fault specs and the thread priority) or once at import
(the coordination timeout, and liveness's two), on any thread.

Variables: ``FOP_BACKGROUND_NICE`` (:func:`lower`, below), ``FOP_COORDINATION_TIMEOUT_S``
(``_base.distributed``), ``FOP_PEER_SILENT_S`` and ``FOP_LATE_REPORT_S``
(``_base.liveness``), ``FOP_DIRECT_IO`` (``_zarr.chunk_writer``), ``FOP_COMMIT``
(``_storage.mounts``), ``FOP_PATHWAYS`` (``_base.pathways``), ``FOP_STORE_RETRIES``
(``_storage.kvstore``), ``FOP_KILL_AT`` and
``FOP_FAIL_AT`` (the fail points below: ``phase``, ``phase:N``, and for ``FOP_FAIL_AT``
``phase:N:ERRNO``), ``FOP_PAUSE_AT`` and ``FOP_PAUSE_S`` (test pause points),
``FOP_SLOW_AT`` and ``FOP_SLOW_S`` (test slow points). ``FOP_COORDINATION_TIMEOUT_S`` is
the default stall timeout (a manager's ``stall_timeout=`` overrides it).

What two of them do lives here too, so that each variable and its effect are read in
one place:

**Fail points** (tests): :func:`kill_point`, :func:`fail_point`, :func:`pause_point`
and :func:`slow_point` are deterministic crash, error, pause and slow points at the
named phases of a save or a read, armed by ``FOP_KILL_AT``, ``FOP_FAIL_AT``,
``FOP_PAUSE_AT`` and ``FOP_SLOW_AT``; design notes: ``docs/internals.md``, section
``flax_orbax_plugin._base.env``.

**Background priority** (:func:`lower`, :func:`initializer`):
A save's background phase writes its chunks (checksums, writes, links) on a pool of
threads while the training steps run. At the same priority a pool of 8 such threads
takes a share of the CPUs per thread while they are runnable, which on a machine whose
training threads use every core slows the steps that overlap a save.
``FOP_BACKGROUND_NICE=<0-19>`` (checked by :func:`read`: any other value is an
OptionError naming it) makes each such thread lower its own priority to that ``nice``
value as its first act (Linux nice values are per thread); 0, the default, leaves it
alone.

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

import collections
import errno
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from .._errors import OptionError
from .option_spec import Option

__all__ = [
    "FaultSpec",
    "InjectedFault",
    "VARIABLES",
    "fail_point",
    "initializer",
    "kill_point",
    "lower",
    "pause_point",
    "read",
    "slow_point",
]


class FaultSpec(NamedTuple):
    """A parsed ``FOP_KILL_AT`` / ``FOP_FAIL_AT``: the phase, from its ``nth`` hit on,
    and (``FOP_FAIL_AT``) the errno name of the injected error."""

    phase: str
    nth: int
    errno_name: str
    text: str


_PHASE = re.compile(r"[a-z][a-z0-9_-]*\Z")


def _fault_spec(text: str, *, with_errno: bool) -> FaultSpec:
    parts = text.split(":")
    if len(parts) > (3 if with_errno else 2) or not _PHASE.match(parts[0]):
        raise ValueError("bad syntax")
    nth = parts[1] if len(parts) > 1 else "1"
    if not nth.isdigit() or int(nth) < 1:
        raise ValueError("bad hit count")
    name = parts[2] if len(parts) > 2 else "EIO"
    if not isinstance(getattr(errno, name, None), int) or not name.isupper():
        raise ValueError("bad errno name")
    return FaultSpec(parts[0], int(nth), name, text)


VARIABLES: dict[str, tuple[Option, Any]] = {
    "FOP_BACKGROUND_NICE": (Option("FOP_BACKGROUND_NICE", "int", low=0, high=19), 0),
    "FOP_COORDINATION_TIMEOUT_S": (
        Option(
            "FOP_COORDINATION_TIMEOUT_S",
            "number",
            low=0,
            low_open=True,
            high=threading.TIMEOUT_MAX,
            expected="a number of seconds > 0",
        ),
        300.0,
    ),
    "FOP_PEER_SILENT_S": (  # _base.liveness: a process silent this long is dead
        Option(
            "FOP_PEER_SILENT_S",
            "number",
            low=0.5,
            high=3600,
            expected="a number of seconds >= 0.5 and <= 3600",
        ),
        10.0,
    ),
    "FOP_LATE_REPORT_S": (  # _base.liveness: a wait this long names the late processes
        Option(
            "FOP_LATE_REPORT_S",
            "number",
            low=0.5,
            high=threading.TIMEOUT_MAX,
            expected="a number of seconds >= 0.5",
        ),
        10.0,
    ),
    "FOP_DIRECT_IO": (Option("FOP_DIRECT_IO", "choice", choices=("0", "1")), "1"),
    # _base.pathways: a save or restore under Pathways (single controller): refused
    "FOP_PATHWAYS": (Option("FOP_PATHWAYS", "choice", choices=("refuse", "allow")), "refuse"),
    # _storage.mounts: how a step commits on a local path (auto: a file on FUSE mounts)
    "FOP_COMMIT": (Option("FOP_COMMIT", "choice", choices=("auto", "rename", "file")), "auto"),
    # _storage.kvstore: retries of an object store request (0.5 s doubling to 10 s)
    "FOP_STORE_RETRIES": (Option("FOP_STORE_RETRIES", "int", low=0, high=100), 8),
    "FOP_KILL_AT": (
        Option(
            "FOP_KILL_AT",
            "custom",
            convert=lambda t: _fault_spec(t, with_errno=False),
            expected="a kill point: 'phase' or 'phase:N' (its N-th hit, N >= 1)",
        ),
        None,
    ),
    "FOP_PAUSE_AT": (  # test pause points (_env.pause_point)
        Option(
            "FOP_PAUSE_AT",
            "custom",
            convert=lambda t: _fault_spec(t, with_errno=False),
            expected="a pause point: 'phase' or 'phase:N' (its N-th hit, N >= 1)",
        ),
        None,
    ),
    "FOP_SLOW_AT": (  # test slow points (_env.slow_point): every pass from the Nth
        Option(
            "FOP_SLOW_AT",
            "custom",
            convert=lambda t: _fault_spec(t, with_errno=False),
            expected="a slow point: 'phase' or 'phase:N' (from its N-th hit, N >= 1)",
        ),
        None,
    ),
    "FOP_SLOW_S": (
        Option("FOP_SLOW_S", "number", low=0, high=3600, expected="seconds >= 0 and <= 3600"),
        1.0,
    ),
    "FOP_PAUSE_S": (
        Option("FOP_PAUSE_S", "number", low=0, high=3600, expected="seconds >= 0 and <= 3600"),
        2.0,
    ),
    "FOP_FAIL_AT": (
        Option(
            "FOP_FAIL_AT",
            "custom",
            convert=lambda t: _fault_spec(t, with_errno=True),
            expected="a fail point: 'phase', 'phase:N' or 'phase:N:ERRNO' (N >= 1, "
            "ERRNO an errno name such as EIO)",
        ),
        None,
    ),
}
"""name -> (declaration, default)."""

_PARSE = {"int": int, "number": float}


def read(name: str) -> Any:
    """The value of the environment variable ``name`` (one of :data:`VARIABLES`),
    checked; its default when unset or empty. OptionError for any other value."""
    option, default = VARIABLES[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = _PARSE.get(option.kind, str)(text)
        return option.check(value)
    except (ValueError, TypeError, OverflowError):
        raise OptionError(
            f"environment variable {name} must be {option.words}, found {text!r}"
        ) from None


# -- fail points (tests) --------------------------------------------------------------

_HITS: collections.Counter[str] = collections.Counter()


class InjectedFault(OSError):
    """The failure ``FOP_FAIL_AT`` asked for (its ``errno`` as asked, EIO by default)."""

    def __str__(self) -> str:
        return str(self.strerror)


def _reached(variable: str, phase: str, key: str) -> FaultSpec | None:
    """The spec in ``variable`` (checked by :func:`read`) when ``phase`` is named there and
    this is its Nth hit."""
    spec = read(variable)
    if spec is None or spec.phase != phase:
        return None
    _HITS[key] += 1
    return spec if _HITS[key] >= spec.nth else None


def kill_point(phase: str) -> None:
    if _reached("FOP_KILL_AT", phase, phase):
        os.kill(os.getpid(), signal.SIGKILL)


def fail_point(phase: str) -> None:
    spec = _reached("FOP_FAIL_AT", phase, f"fail:{phase}")
    if spec:
        code = getattr(errno, spec.errno_name)
        raise InjectedFault(code, f"injected fault at {phase} (FOP_FAIL_AT={spec.text})")


def pause_point(phase: str) -> None:
    """``FOP_PAUSE_AT=<phase>[:<nth>]``: at the Nth pass, writes ``FOP_PAUSED <phase>``
    to stderr and sleeps ``FOP_PAUSE_S`` seconds (default 2), so a test can send a real
    signal while a save is exactly there."""
    if _reached("FOP_PAUSE_AT", phase, f"pause:{phase}"):
        os.write(2, f"FOP_PAUSED {phase}\n".encode())
        time.sleep(read("FOP_PAUSE_S"))


def slow_point(phase: str) -> None:
    """``FOP_SLOW_AT=<phase>[:<nth>]``: from the Nth pass on, every pass sleeps
    ``FOP_SLOW_S`` seconds (default 1), so a test can make a write or a read slow but
    progressing (``write``: after each region a save hands out, ``read``: after each
    read a restore completes)."""
    if _reached("FOP_SLOW_AT", phase, f"slow:{phase}"):
        time.sleep(read("FOP_SLOW_S"))


# -- background priority -----------------------------------------------------------------


def lower() -> None:
    """Lowers the calling thread's CPU priority to ``FOP_BACKGROUND_NICE`` (never
    raises an OSError; a no-op off Linux). Call only as the first act of a thread
    that starts no thread and calls no store's client (see the module docstring)."""
    nice = read("FOP_BACKGROUND_NICE")
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
    read("FOP_BACKGROUND_NICE")
    return lower if local_only else None
