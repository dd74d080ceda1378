"""Deterministic kill points for crash tests.

``kill_point(phase)`` SIGKILLs the current process when the environment variable
``FOP_KILL_AT`` names ``phase`` (``phase`` or ``phase:N`` for its N-th hit, 1-based).
Costs one dictionary lookup when the variable is unset. Phases of a save, in order:
``after_snapshot``, ``mid_write``, ``after_sync``, ``after_metadata``, ``after_marker``,
``mid_rename``; and ``mid_retention`` while a step is being deleted.
"""

from __future__ import annotations

import collections
import os
import signal

_HITS: collections.Counter[str] = collections.Counter()


def kill_point(phase: str) -> None:
    spec = os.environ.get("FOP_KILL_AT")
    if not spec:
        return
    name, _, nth = spec.partition(":")
    if name != phase:
        return
    _HITS[phase] += 1
    if _HITS[phase] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
