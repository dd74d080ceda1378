"""Deterministic kill points for crash tests.

``kill_point(phase)`` SIGKILLs the current process when the environment variable
``FOP_KILL_AT`` names ``phase`` (``phase`` or ``phase:N`` for its N-th hit, 1-based).
Costs one dictionary lookup when the variable is unset. Phases of a save, in order:
``after_snapshot``, ``mid_write``, ``after_sync``, ``after_metadata``, ``after_marker``,
``mid_rename``; ``mid_retention`` while a step is being deleted; ``mid_replication``
after each file copied to (or down from) a persistent tier (``_tiers``).

``fail_point(phase)`` raises :class:`InjectedFault` (an ``OSError``) instead, from the
N-th hit on, when ``FOP_FAIL_AT`` names ``phase`` (same syntax, plus an optional errno
name: ``read_chunk:1:EMFILE``; EIO by default): a process keeps running and reports
the error as a real I/O failure would. Phases: ``replicate_file`` before each file a
process copies to a persistent tier, ``copy_down_file`` before each file copied down
from it, ``read_chunk`` before each chunk file the direct reader opens, ``write_small``
before each small file (JSON, markers) written on local disk.
"""

from __future__ import annotations

import collections
import errno
import os
import signal

_HITS: collections.Counter[str] = collections.Counter()


class InjectedFault(OSError):
    """The failure ``FOP_FAIL_AT`` asked for (its ``errno`` as asked, EIO by default)."""

    def __str__(self) -> str:
        return str(self.strerror)


def _reached(variable: str, phase: str, key: str) -> str | None:
    """The spec in ``variable`` when ``phase`` is named there and this is its Nth hit."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    nth = nth.split(":", 1)[0]
    if name != phase:
        return None
    _HITS[key] += 1
    return spec if _HITS[key] >= int(nth or 1) else None


def kill_point(phase: str) -> None:
    if _reached("FOP_KILL_AT", phase, phase):
        os.kill(os.getpid(), signal.SIGKILL)


def fail_point(phase: str) -> None:
    spec = _reached("FOP_FAIL_AT", phase, f"fail:{phase}")
    if spec:
        parts = spec.split(":")
        code = getattr(errno, parts[2], errno.EIO) if len(parts) > 2 else errno.EIO
        raise InjectedFault(code, f"injected fault at {phase} (FOP_FAIL_AT={spec})")
