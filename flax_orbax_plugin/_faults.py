"""Deterministic crash points for tests: SIGKILL this process at a named phase of a save.

The save path calls :func:`kill_point` at each phase boundary. When the environment
variable ``FOP_KILL_AT`` names that phase the process sends itself SIGKILL there, so
a test can crash a real saving process at an exact moment instead of after a guessed
delay. ``FOP_KILL_AT=phase:N`` kills at the N-th time this process reaches the phase
(counted from 1). Unset, a call is one environment lookup.

Phases (in the order one step's save reaches them; see :data:`PHASES`):

* core save (``_save``), once per saved pytree:
  ``snapshot`` the blocking phase has copied every byte to host memory;
  ``mid_write`` the first chunk write handed to tensorstore has completed, others
  may still be pending; ``synced`` this process's chunks are durable (syncfs);
  ``metadata`` ``_METADATA.json`` is written; ``marker`` ``_COMMITTED`` is written;
  ``rename`` just before the temporary directory is renamed into place (on a forced
  replacement the old checkpoint has already been moved aside).
* manager (``_manager``), once per step:
  ``manifest`` the step's manifest is written, the step not yet renamed into place;
  ``step_rename`` forced replacement of a step: the old step is moved aside, the
  new one not yet renamed into place; ``retention`` an old step is renamed to
  ``<step>.deleting-*`` (local) or uncommitted (object stores), its files not yet
  removed.

Never set ``FOP_KILL_AT`` outside tests.
"""

from __future__ import annotations

import collections
import os
import signal
import threading

ENV = "FOP_KILL_AT"

PHASES = (
    "snapshot",
    "mid_write",
    "synced",
    "metadata",
    "marker",
    "rename",
    "manifest",
    "step_rename",
    "retention",
)

_hits: collections.Counter[str] = collections.Counter()
_hits_lock = threading.Lock()


def kill_point(phase: str) -> None:
    """SIGKILLs this process if ``FOP_KILL_AT`` names ``phase`` (and this is hit N)."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    name, _, nth = wanted.partition(":")
    if name != phase:
        return
    with _hits_lock:
        _hits[phase] += 1
        hit = _hits[phase]
    if hit == (int(nth) if nth else 1):
        os.kill(os.getpid(), signal.SIGKILL)
