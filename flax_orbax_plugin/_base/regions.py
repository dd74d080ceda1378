"""A collective operation's region (:class:`Region`: its kind, its tag, the names drawn
in it) and what this process's threads are doing (:data:`ACTIVITIES`, which its
heartbeat publishes: ``_base/liveness.py``). A region is an explicit input, drawn by
the public entry point (``_base/distributed.py``) on the thread that makes the SPMD
calls (the same order on every process) and handed down as an argument;
:data:`ACTIVITIES` is thread-safe, a stack per thread. With them, the coordination
client and the count of the calls made to it.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.regions``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator

from .._errors import CoordinationError

__all__ = [
    "ACTIVITIES",
    "CALLS",
    "Activities",
    "Progress",
    "Region",
    "client",
]


@dataclasses.dataclass
class Progress:
    """Bytes an activity has moved (``done``) of those handed to it so far (``total``);
    updated by the thread doing the work, read by the heartbeat thread."""

    done: int = 0
    total: int = 0

    def words(self) -> str:
        left = max(self.total - self.done, 0)
        return f"{self.done / (1 << 20):.1f} MiB done, {left / (1 << 20):.1f} MiB left"


@dataclasses.dataclass
class _Activity:
    what: str
    since: float
    progress: Progress | None = None


class Activities:
    """What this process's threads are doing (a stack per thread, innermost last)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stacks: dict[int, list[_Activity]] = {}

    @contextlib.contextmanager
    def doing(self, what: str, *, moving: bool = False) -> Iterator[Progress | None]:
        """Records ``what`` as this thread's current activity for the body; ``moving``:
        the body moves bytes and reports them in the :class:`Progress` it is given."""
        entry = self.begin(what, moving=moving)
        try:
            yield entry.progress
        finally:
            self.end(entry)

    def begin(self, what: str, *, moving: bool = False) -> _Activity:
        """:meth:`doing` for a body that is no ``with`` block: pair with :meth:`end`."""
        entry = _Activity(what, time.monotonic(), Progress() if moving else None)
        with self._lock:
            self._stacks.setdefault(threading.get_ident(), []).append(entry)
        return entry

    def end(self, entry: _Activity) -> None:
        """Ends ``entry`` (begun on this thread)."""
        me = threading.get_ident()
        with self._lock:
            stack = self._stacks.get(me, [])
            if entry in stack:
                stack.remove(entry)
            if not stack:
                self._stacks.pop(me, None)

    def signature(self) -> tuple:
        """What changes when this process progresses: each activity and its bytes done
        (compared between two beats by the heartbeat thread)."""
        with self._lock:
            stacks = [list(s) for s in self._stacks.values()]
        return tuple(
            (a.what, a.since, None if a.progress is None else a.progress.done)
            for stack in stacks
            for a in stack
        )

    def describe(self) -> list[str]:
        """One line per busy thread: its activities, outermost first, with their bytes."""
        now = time.monotonic()
        with self._lock:
            stacks = [list(s) for s in self._stacks.values() if s]
        lines = []
        for stack in stacks:
            parts = []
            for a in stack:
                part = f"{a.what} ({now - a.since:.0f} s"
                part += f", {a.progress.words()})" if a.progress is not None else ")"
                parts.append(part)
            lines.append(" > ".join(parts))
        return sorted(lines)


ACTIVITIES = Activities()  # this process's (one per process, like its coordination client)


# Coordination calls made by this process, by kind ("barrier", "kv_set", "kv_get",
# "kv_delete", "failure_check"): tests assert how many one save costs.
CALLS: collections.Counter[str] = collections.Counter()


def client():
    """jax's coordination service client (raises CoordinationError without one)."""
    from jax._src.distributed import global_state  # private: read when called, not at import

    found = global_state.client
    if found is None:
        raise CoordinationError(
            "several JAX processes but no coordination client: call jax.distributed.initialize()"
        )
    return found


@dataclasses.dataclass
class Region:
    """One collective operation: its kind (``manager-save`` ...) and its tag, the same on
    every process (the n-th collective operation of this process); the names drawn in it
    so far (:attr:`drawn`), the agreement it is in and those it completed, its waits'
    stall timeout (``stall_s``, seconds; None: ``FOP_COORDINATION_TIMEOUT_S``), and its
    ``scope``: the tag of the open of the manager it is an operation of (whose
    processes may announce that they left it: :func:`announce_leaving`), or None.
    Handed down explicitly (see the module docstring); its names are drawn on the
    thread that makes the SPMD calls, or by a background phase after that thread's
    last draw in it (``SaveHandle``)."""

    kind: str
    tag: str
    drawn: int = 0
    stall_s: float | None = None
    scope: str | None = None
    agreeing: str | None = None
    agreed: set[str] = dataclasses.field(default_factory=set)

    def draw(self) -> str:
        """``<tag>.<n>``: the n-th name drawn in this region."""
        self.drawn += 1
        return f"{self.tag}.{self.drawn - 1}"
