"""Deterministic kill points for crash tests.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.faults``.
"""

from __future__ import annotations

import collections
import errno
import os
import signal
import time

from . import env as _env

_HITS: collections.Counter[str] = collections.Counter()


class InjectedFault(OSError):
    """The failure ``FOP_FAIL_AT`` asked for (its ``errno`` as asked, EIO by default)."""

    def __str__(self) -> str:
        return str(self.strerror)


def _reached(variable: str, phase: str, key: str) -> _env.FaultSpec | None:
    """The spec in ``variable`` (checked by ``_env``) when ``phase`` is named there and
    this is its Nth hit."""
    spec = _env.read(variable)
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
        time.sleep(_env.read("FOP_PAUSE_S"))


def slow_point(phase: str) -> None:
    """``FOP_SLOW_AT=<phase>[:<nth>]``: from the Nth pass on, every pass sleeps
    ``FOP_SLOW_S`` seconds (default 1), so a test can make a write or a read slow but
    progressing (``write``: after each region a save hands out, ``read``: after each
    read a restore completes)."""
    if _reached("FOP_SLOW_AT", phase, f"slow:{phase}"):
        time.sleep(_env.read("FOP_SLOW_S"))
