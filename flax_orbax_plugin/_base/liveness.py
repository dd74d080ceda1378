"""Liveness by progress: this process's heartbeat (what its threads are doing,
``host.ACTIVITIES``) and the judge of the processes a wait waits for
(:class:`PeerWatch`: dead, stalled, on another path, only waiting for each other, late).
A process named dead stays dead for later waits (:data:`_DEAD`) until its heartbeat
moves. Only several processes reach here.

Threading: one heartbeat thread per process; a :class:`PeerWatch` is used by the one
thread that waits; the record of dead processes is shared by every waiting thread
(under its lock).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.regions``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from .._errors import CoordinationError
from . import env as _env
from .failures import raise_elsewhere
from .host import ACTIVITIES, Activities, Progress

ALIVE = "fop/alive"  # ALIVE/<process>: that process's heartbeat (JSON)
LOOK_S = 1.0  # how often a wait reads the heartbeats (its first look: at its first slice's end)
# Read once, at import: a bad value is refused at the package's first use, everywhere.
PEER_SILENT_S, LATE_REPORT_S = _env.read("FOP_PEER_SILENT_S"), _env.read("FOP_LATE_REPORT_S")
logger = logging.getLogger("flax_orbax_plugin")


def progress_signature(activities: Activities) -> tuple:
    """What changes when this process progresses: each activity and its bytes done."""
    return tuple(
        (a.what, a.since, None if a.progress is None else a.progress.done)
        for stack in activities.stacks()
        for a in stack
    )


def activity_lines(activities: Activities) -> list[str]:
    """One line per busy thread: its activities, outermost first, with their bytes."""
    now = time.monotonic()
    lines = []
    for stack in activities.stacks():
        parts = []
        for a in stack:
            part = f"{a.what} ({now - a.since:.0f} s"
            part += f", {_words(a.progress)})" if a.progress is not None else ")"
            parts.append(part)
        lines.append(" > ".join(parts))
    return sorted(lines)


def _words(progress: Progress) -> str:
    left = max(progress.total - progress.done, 0)
    return f"{progress.done / (1 << 20):.1f} MiB done, {left / (1 << 20):.1f} MiB left"


class _Heartbeat:
    """The thread that publishes this process's heartbeat (see the module docstring)."""

    def __init__(self, client: Any, process: int, period_s: float):
        self._client, self._key, self._period = client, f"{ALIVE}/{process}", period_s
        self._thread = threading.Thread(target=self._run, name="fop-heartbeat", daemon=True)
        self.beats = 0
        self.moved = 0  # beats at which this process had progressed since the last one
        self._last: tuple | None = None

    def start(self) -> _Heartbeat:
        with contextlib.suppress(Exception):  # the thread tries again; a wait reports it
            self._beat()  # the first beat before the first wait, on the caller's thread
        self._thread.start()
        return self

    def _beat(self) -> None:
        self.beats += 1
        now = progress_signature(ACTIVITIES)
        if now != self._last:
            self._last, self.moved = now, self.moved + 1
        doc = {"beat": self.beats, "moved": self.moved, "doing": activity_lines(ACTIVITIES)[:8]}
        self._client.key_value_set(self._key, json.dumps(doc), allow_overwrite=True)

    def _run(self) -> None:
        failures = 0
        while failures < 5:  # the service gone (shutdown, or the primary died): stop
            time.sleep(self._period)
            try:
                self._beat()
                failures = 0
            except Exception:  # noqa: BLE001  (a wait reports a service gone itself)
                failures += 1


_BEATING: dict[int, _Heartbeat] = {}  # id(client) -> its heartbeat: one per session
_BEATING_LOCK = threading.Lock()


def ensure_beating(client: Any, process: int) -> None:
    """Starts this process's heartbeat for ``client`` (once per coordination client)."""
    with _BEATING_LOCK:
        if id(client) not in _BEATING:
            period = min(1.0, PEER_SILENT_S / 4)
            _BEATING[id(client)] = _Heartbeat(client, process, period).start()


@dataclasses.dataclass(frozen=True)
class _Seen:
    beat: int
    at: float  # monotonic time the beat was first seen at this value
    doing: list[str]
    moved: int = 0  # its progress counter
    moved_at: float = 0.0  # monotonic time the progress counter was first seen at this value


# (id(client), process) -> (client, its last heartbeat seen) of a process named dead in
# that session. The client is kept (so its id is never reused while listed) and compared.
_DEAD: dict[tuple[int, int], tuple[Any, _Seen]] = {}
_DEAD_LOCK = threading.Lock()


def _dead_record(client: Any, process: int) -> _Seen | None:
    with _DEAD_LOCK:
        found = _DEAD.get((id(client), process))
    return found[1] if found is not None and found[0] is client else None


def _only_waiting(lines: list[str]) -> bool:
    """Whether every busy thread of a process (its activity lines) is waiting for
    another process, innermost (so it makes no progress of its own)."""
    return bool(lines) and all(
        line.rsplit(" > ", 1)[-1].startswith("waiting for ") for line in lines
    )


class PeerWatch:
    """One wait's judge of the processes it waits for (see the module docstring).

    ``what``: the wait, in words (``barrier 'fop/...'``); ``late()``: the processes it
    still waits for (called only when a report is due); ``stall_s``: the stall timeout,
    how long a process may make no progress; ``region``: the wait's
    ``distributed.Region``, if any (typed ``Any``: that module imports this one)."""

    def __init__(
        self,
        client: Any,
        me: int,
        what: str,
        *,
        stall_s: float,
        late: Callable[[], list[int]],
        region: Any = None,
    ):
        self._client, self._me, self._what, self._late = client, me, what, late
        self._stall_s = stall_s
        unset = region is None or region.stall_s is None
        self._region = region if region is not None and region.spans else None  # None: no path
        self._stall_name = "FOP_COORDINATION_TIMEOUT_S" if unset else "stall_timeout"
        self._silent_s, self._report_s = PEER_SILENT_S, LATE_REPORT_S
        self._start = time.monotonic()
        # The first look at once: a process's silence is counted from its beat first seen,
        # so a look put off by a second would put off naming a dead process by as much.
        self._next_look = self._start
        self._next_report = self._start + self._report_s
        self._seen: dict[int, _Seen] = {}
        self._mutual_since: float | None = None
        self._recalled: set[int] = set()  # the processes looked up in _DEAD already

    def look(self, process: int) -> None:
        """Between two slices of the wait for ``process``: raises CoordinationError when
        it is dead or stalled; logs the late processes when a report is due. Reads the
        heartbeats at most once per :data:`LOOK_S`."""
        now = time.monotonic()
        if process not in self._recalled:
            self._recalled.add(process)
            self._still_dead(process, now)
        if now < self._next_look:
            return
        self._next_look = now + LOOK_S
        self._read(now, [process])
        seen = self._seen.get(process)
        if seen is None:
            if now - self._start >= self._stall_s:
                raise CoordinationError(
                    f"{self._prefix()}process {process} showed no heartbeat within "
                    f"{self._stall_s:g}s ({self._stall_name}): it never reached "
                    f"its first coordination call, or died before it"
                )
        elif now - seen.at >= self._silent_s:
            with _DEAD_LOCK:
                _DEAD[(id(self._client), process)] = (self._client, seen)
            raise self._dead(process, seen, now)
        else:
            self._check_path(process, seen)
            if _only_waiting(seen.doing):
                self._check_mutual(process, seen, now)
            else:
                self._mutual_since = None
                self._check_stalled(process, seen, now)
        if now >= self._next_report:
            self._next_report = now + self._report_s
            self._report(now)

    def _still_dead(self, process: int, now: float) -> None:
        """At this wait's first look at ``process``: raises CoordinationError at once when
        an earlier wait named it dead and its heartbeat has not moved since; one that
        beats again (it was only frozen) is forgotten."""
        dead = _dead_record(self._client, process)
        if dead is None:
            return
        self._read(now, [process])
        seen = self._seen.get(process)
        if seen is not None and seen.beat != dead.beat:
            with _DEAD_LOCK:
                if _DEAD.get((id(self._client), process), (None, None))[1] is dead:
                    del _DEAD[(id(self._client), process)]
            return
        raise self._dead(process, dead, now, "; named dead by an earlier wait, not beaten since")

    def _dead(self, process: int, seen: _Seen, now: float, why: str = "") -> CoordinationError:
        return CoordinationError(
            f"{self._prefix()}process {process} is dead: its heartbeat stopped "
            f"{now - seen.at:.1f}s ago (FOP_PEER_SILENT_S={self._silent_s:g}{why}); it was "
            f"{self._doing(seen)}"
        )

    def _check_stalled(self, process: int, seen: _Seen, now: float) -> None:
        """A live process doing something of its own (or nothing of ours) is given as
        long as its bytes or activities change within the stall timeout."""
        still = now - max(seen.moved_at, self._start)
        if still >= self._stall_s and not seen.doing:
            raise CoordinationError(
                f"{self._prefix()}process {process} is alive but has not made this call: "
                f"for {still:.1f}s ({self._stall_name}={self._stall_s:g}) it was doing "
                f"nothing of this library's; was this collective call made on some processes "
                f"only? Every process makes them, in the same order"
            )
        if still >= self._stall_s:
            raise CoordinationError(
                f"{self._prefix()}process {process} is alive but stalled: no progress "
                f"(bytes moved, activity begun or ended) for {still:.1f}s "
                f"({self._stall_name}={self._stall_s:g}); it was {self._doing(seen)}"
            )

    def _check_path(self, process: int, seen: _Seen) -> None:
        """A process whose operation of this wait's number is of another kind took
        another path and never sets the value: ``elsewhere(process, its kind, doing)``
        raises at once."""
        if self._region is None:
            return
        for line in seen.doing:
            for m in _OPERATION.finditer(line):
                if m.group(2) == self._region.tag and m.group(1) != self._region.kind:
                    raise_elsewhere(self._region, process, m.group(1), self._doing(seen))

    def _check_mutual(self, process: int, seen: _Seen, now: float) -> None:
        """Two live processes that only wait for each other: limited by the stall timeout."""
        mutual = any(f"from process {self._me} (" in line for line in seen.doing)
        if not (mutual and _only_waiting(activity_lines(ACTIVITIES))):
            self._mutual_since = None
            return
        if self._mutual_since is None:
            self._mutual_since = now
        if now - self._mutual_since >= self._stall_s:
            raise CoordinationError(
                f"{self._prefix()}process {process} and this one have only waited for each "
                f"other for {now - self._mutual_since:.0f}s ({self._stall_name}): "
                f"they took different paths; process {process} was {self._doing(seen)}"
            )

    def _read(self, now: float, processes: list[int]) -> None:
        """Reads the heartbeats of ``processes`` (one key each)."""
        for process in processes:
            try:
                value = self._client.key_value_try_get(f"{ALIVE}/{process}")
            except Exception:  # noqa: BLE001  (not beating yet, or a service gone)
                continue
            try:
                doc = json.loads(value)
                beat, doing = int(doc["beat"]), [str(d) for d in doc.get("doing", [])]
                moved = int(doc.get("moved", 0))
            except (ValueError, KeyError, TypeError):
                continue
            old = self._seen.get(process)
            if old is None or old.beat != beat:
                moved_at = now if old is None or old.moved != moved else old.moved_at
                self._seen[process] = _Seen(beat, now, doing, moved, moved_at)

    def _prefix(self) -> str:
        where = "" if self._region is None else f" in {self._region.kind}"
        return f"process {self._me}{where}, waiting for {self._what}: "

    @staticmethod
    def _doing(seen: _Seen) -> str:
        return "doing " + "; ".join(seen.doing) if seen.doing else "doing nothing of ours"

    def _report(self, now: float) -> None:
        """Logs the late processes and, behind them, those they wait for in turn."""
        late = self._late()
        self._read(now, [p for p in late if p != self._me])
        behind: list[int] = []
        frontier = list(late)
        while frontier and len(behind) < 8:  # who the late ones wait for, and so on
            for q in self._waits_for(frontier.pop(0)):
                if q != self._me and q not in late and q not in behind:
                    self._read(now, [q])
                    behind.append(q)
                    frontier.append(q)
        logger.warning(
            "%shas waited %.0fs; late: %s%s",
            self._prefix(),
            now - self._start,
            ", ".join(self._words(p, now) for p in late) or "none (the value is on its way)",
            f"; behind them: {', '.join(self._words(q, now) for q in behind)}" if behind else "",
        )

    def _waits_for(self, process: int) -> list[int]:
        """The processes ``process``'s threads wait for, innermost (from its heartbeat)."""
        seen = self._seen.get(process)
        found = []
        for line in seen.doing if seen is not None else []:
            m = _WAITING.match(line.rsplit(" > ", 1)[-1])
            if m is not None and int(m.group(1)) not in found:
                found.append(int(m.group(1)))
        return found

    def _words(self, p: int, now: float) -> str:
        seen = self._seen.get(p)
        if seen is None:
            return f"process {p} (no heartbeat seen yet)"
        return f"process {p} (alive, beat {now - seen.at:.1f}s ago, {self._doing(seen)})"


_WAITING = re.compile(r"waiting for .* from process ([0-9]+) \(")
_OPERATION = re.compile(r"([\w-]+) \(operation ([^)]+)\)")  # an activity of distributed.resumed
