"""Regions of collective operations, the failures published in them, and liveness by
progress (heartbeats, what each process is doing, late peers named). A region is an
explicit input, drawn by the public entry point on the thread that makes the SPMD calls
(the same order on every process) and handed down as an argument; one heartbeat thread
per process (a daemon); :data:`ACTIVITIES` is thread-safe, a stack per thread; a
:class:`PeerWatch` is used by the one thread that waits.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.regions``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .._errors import CheckpointError, CoordinationError, ProcessFailedError
from . import env as _env
from . import host as _host

__all__ = ["ACTIVITIES", "Activities", "PeerWatch", "Progress", "ensure_beating"]

ALIVE = "fop/alive"  # ALIVE/<process>: that process's heartbeat (JSON)
LOOK_S = 1.0  # how often a wait reads the heartbeats (and how long before its first look)
# Read once, at import: a bad value is refused at the package's first use, everywhere.
PEER_SILENT_S, LATE_REPORT_S = _env.read("FOP_PEER_SILENT_S"), _env.read("FOP_LATE_REPORT_S")
logger = logging.getLogger("flax_orbax_plugin")


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


class _Heartbeat:
    """The thread that publishes this process's heartbeat (see the module docstring)."""

    def __init__(self, client: Any, process: int, period_s: float):
        self._client, self._key, self._period = client, f"{ALIVE}/{process}", period_s
        self._thread = threading.Thread(target=self._run, name="fop-heartbeat", daemon=True)
        self.beats = 0
        self.moved = 0  # beats at which this process had progressed since the last one
        self._last: tuple | None = None

    def start(self) -> _Heartbeat:
        try:
            self._beat()  # the first beat before the first wait, on the caller's thread
        except Exception:  # noqa: BLE001  (the thread tries again; a wait reports a service gone)
            pass
        self._thread.start()
        return self

    def _beat(self) -> None:
        self.beats += 1
        now = ACTIVITIES.signature()
        if now != self._last:
            self._last, self.moved = now, self.moved + 1
        doc = {"beat": self.beats, "moved": self.moved, "doing": ACTIVITIES.describe()[:8]}
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


@dataclasses.dataclass
class _Seen:
    beat: int
    at: float  # monotonic time the beat was first seen at this value
    doing: list[str]
    moved: int = 0  # its progress counter
    moved_at: float = 0.0  # monotonic time the progress counter was first seen at this value


def _only_waiting(lines: list[str]) -> bool:
    """Whether every busy thread of a process (its :meth:`Activities.describe` lines) is
    waiting for another process, innermost (so it makes no progress of its own)."""
    return bool(lines) and all(
        line.rsplit(" > ", 1)[-1].startswith("waiting for ") for line in lines
    )


class PeerWatch:
    """One wait's judge of the processes it waits for (see the module docstring).

    ``what``: the wait, in words (``barrier 'fop/...'``); ``late()``: the processes it
    still waits for (called only when a report is due); ``stall_s``: the stall timeout,
    how long a process may make no progress (``stall_name``: the option that set it)."""

    def __init__(
        self,
        client: Any,
        me: int,
        what: str,
        *,
        stall_s: float,
        late: Callable[[], list[int]],
        region: str | None = None,
        stall_name: str = "FOP_COORDINATION_TIMEOUT_S",
        operation: tuple[str, str] | None = None,
        elsewhere: Callable[[int, str, str], None] | None = None,
    ):
        self._client, self._me, self._what, self._late = client, me, what, late
        self._region, self._operation, self._elsewhere = region, operation, elsewhere
        self._stall_s, self._stall_name = stall_s, stall_name
        self._silent_s, self._report_s = PEER_SILENT_S, LATE_REPORT_S
        self._start = time.monotonic()
        self._next_look = self._start + LOOK_S
        self._next_report = self._start + self._report_s
        self._seen: dict[int, _Seen] = {}
        self._mutual_since: float | None = None

    def look(self, process: int) -> None:
        """Between two slices of the wait for ``process``: raises CoordinationError when
        it is dead or stalled; logs the late processes when a report is due. Reads the
        heartbeats at most once per :data:`LOOK_S`."""
        now = time.monotonic()
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
            raise CoordinationError(
                f"{self._prefix()}process {process} is dead: its heartbeat stopped "
                f"{now - seen.at:.1f}s ago (FOP_PEER_SILENT_S={self._silent_s:g}); it was "
                f"{self._doing(seen)}"
            )
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

    def _check_stalled(self, process: int, seen: _Seen, now: float) -> None:
        """A live process doing something of its own (or nothing of ours) is given as
        long as it progresses: its bytes or its activities changed within the stall
        timeout. One that only waits for a third process is not judged here (the third's
        waiter judges it, and its error reaches this one through the region)."""
        still = now - max(seen.moved_at, self._start)
        if still >= self._stall_s and not seen.doing:
            raise CoordinationError(
                f"{self._prefix()}process {process} is alive but has not made this call: "
                f"for {still:.1f}s ({self._stall_name}={self._stall_s:g}) it was doing "
                f"nothing of this library's. A collective call (a save or read with "
                f"several processes, a manager's save, restore or close) must be made by "
                f"every process, in the same order; was it called on some processes only?"
            )
        if still >= self._stall_s:
            raise CoordinationError(
                f"{self._prefix()}process {process} is alive but stalled: no progress "
                f"(bytes moved, activity begun or ended) for {still:.1f}s "
                f"({self._stall_name}={self._stall_s:g}); it was {self._doing(seen)}"
            )

    def _check_path(self, process: int, seen: _Seen) -> None:
        """A process whose operation of this wait's number (``operation``: its kind and
        tag) is of another kind took another path (an error sent it elsewhere, or a
        collective call made on some processes only): it never sets the value.
        ``elsewhere(process, its kind, what it is doing)`` raises, at once."""
        if self._operation is None or self._elsewhere is None:
            return
        kind, tag = self._operation
        for line in seen.doing:
            for m in _OPERATION.finditer(line):
                if m.group(2) == tag and m.group(1) != kind:
                    self._elsewhere(process, m.group(1), self._doing(seen))

    def _check_mutual(self, process: int, seen: _Seen, now: float) -> None:
        """Two live processes can still make no progress: each only waits, one for the
        other (they took different paths). That is limited by the stall timeout."""
        mutual = any(f"from process {self._me} (" in line for line in seen.doing)
        if not (mutual and _only_waiting(ACTIVITIES.describe())):
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
        """Reads the heartbeats of ``processes`` (one key each: a wait on one process
        costs one read a second, whatever the number of processes)."""
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
        where = f" in {self._region}" if self._region else ""
        return f"process {self._me}{where}, waiting for {self._what}: "

    @staticmethod
    def _doing(seen: _Seen) -> str:
        return "doing " + "; ".join(seen.doing) if seen.doing else "doing nothing of ours"

    def _report(self, now: float) -> None:
        """Logs the late processes and, behind them, those they wait for in turn (the
        straggler at the end of the chain is the one to look at)."""
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
_OPERATION = re.compile(r"([\w-]+) \(operation ([^)]+)\)")  # an activity of regions.resumed


FAILED = "fop/failed"  # FAILED/<region>/<process>: a failure leaving that region
LEFT = "fop/left"  # LEFT/<scope>/<process>: it left that scope (announce_leaving)
PROGRAM = "program"  # the scope of waits outside a manager's: a process whose program ended
_REGIONS = itertools.count()

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


@contextlib.contextmanager
def collective(
    kind: str, *, spans: bool = True, stall_s: float | None = None, scope: str | None = None
) -> Iterator[Region | None]:
    """A collective operation of every process (a context manager): draws a region and
    gives it to the body (``with collective(...) as region``), which hands it down; in
    it, waits raise :class:`ProcessFailedError` once another process published a
    failure, and its error, leaving it, is published for the others.

    ``spans=False``: this call is not collective (e.g. a restore onto host arrays, which
    one process may make alone); no region is drawn (the body gets None). With one
    process: None too. Each call draws a new region, nested or not: internals that
    continue an operation are handed its region instead of entering this. ``stall_s``:
    the stall timeout of the region's waits (see ``_base/regions.py``); ``scope``: the
    region's (see :class:`Region`). Call it on the thread that makes the SPMD calls."""
    _host.refuse_if_detected(kind)  # every public save and restore enters here
    if not spans or jax.process_count() == 1:
        yield None
        return
    with contextlib.suppress(CoordinationError):  # no client: the first wait says so
        ensure_beating(client(), jax.process_index())  # before any wait on us
    _host.at_exit(_host.ANNOUNCE, _announce_program_end)
    region = Region(kind, str(next(_REGIONS)), stall_s=stall_s, scope=scope)
    with resumed(region):
        yield region


def _announce_program_end() -> bool:
    """At exit (``_base.host``, once the saves still running ended), in a process that
    took part in a collective operation: says that it left :data:`PROGRAM`, with the
    exception that ended it (if one did). A wait for one of its values that it set
    before goes on (:func:`raise_if_left`): a run that ended well is not affected."""
    ended = getattr(sys, "last_value", None) or CheckpointError("its program ended")
    announce_leaving(ended, scope=PROGRAM, where="the program")
    return False


@contextlib.contextmanager
def failing_before(kind: str, *, spans: bool = True) -> Iterator[None]:
    """Checks made before the region of the operation they belong to is drawn (the
    callback's options, checked by its constructor; its manager opens at its first
    use): an error leaving the body is published in a region drawn for it then, this
    process's n-th collective operation, the one the others draw for that operation
    (``kind``), so that they raise at once there rather than wait for it. Draws
    nothing when the body succeeds; ``spans=False``: the operation is not collective."""
    try:
        yield
    except Exception:
        with collective(kind, spans=spans):
            raise


def collective_method(kind: str, *, stall: str, scope: str) -> Callable:
    """A decorator for a method whose body takes the keyword ``region``: each call is
    :func:`collective`, its region handed to the body as ``region=`` (the decorated
    method takes the body's other parameters), its stall timeout the attribute
    ``stall`` of the object it is called on (set by its constructor from its options:
    e.g. a manager's ``stall_timeout=``), its scope the attribute ``scope`` (e.g. the
    tag of the manager's open). The region of a call is also the decorated method's
    attribute ``_fop_region(self, *args, **kwargs)``: a check of the call made around
    it (an unknown keyword, ``_base.env``) fails in it."""

    def region(self: Any, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        stall_s, scope_tag = getattr(self, stall, None), getattr(self, scope, None)
        return collective(kind, stall_s=stall_s, scope=scope_tag)

    return _decorator(region)


# ``errors(error, arguments)``: the error to raise in place of ``error`` (None: as it
# is), from the call's bound arguments (``_storage.kvstore.refusals``).
Errors = Callable[[BaseException, dict[str, Any]], BaseException | None]


def public(
    kind: str | None = None,
    *,
    spans: Callable[..., bool] | None = None,
    errors: Errors | None = None,
) -> Callable:
    """The one decorator of a public operation, its entry: each call

    * refuses a keyword the function does not take, naming the one meant ("did you
      mean"; ``_base.env``), in the call's region;
    * with ``kind``, is a collective operation (:func:`collective` when ``spans(*args,
      **kwargs)`` says from the arguments that this call is one, e.g. a like on devices
      of other processes; None: always): the body takes the
      keyword ``region`` and is handed the region drawn (or None); without ``kind`` it
      is a call of one process, no region drawn;
    * raises, in place of an error of the body, what ``errors`` makes of it (see
      :data:`Errors`; e.g. a store's refusal as StoreAccessError), inside the region,
      so that the other processes learn that one.

    The signature shown is the body's (without ``region``). The package's own calls of
    the decorated name go through the same entry. Threading: the caller's."""

    def region(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        if kind is None:
            return contextlib.nullcontext()
        _host.refuse_if_detected(kind)  # before ``spans`` looks at any device
        try:
            spanning = spans is None or spans(*args, **kwargs)
        except TypeError:  # arguments the function refuses (one missing): it says so itself
            spanning = False
        return collective(kind, spans=spanning)

    def decorate(body: Callable) -> Callable:
        shown = inspect.signature(body)
        takes = _env.keywords_taken(body)
        owner = body.__qualname__

        @functools.wraps(body)
        def call(*args: Any, **kwargs: Any) -> Any:
            with region(*args, **kwargs) as drawn:
                if takes is not None and not takes.issuperset(kwargs):
                    raise _env.unknown_keywords(owner, kwargs, takes)
                try:
                    if kind is None:
                        return body(*args, **kwargs)
                    return body(*args, region=drawn, **kwargs)
                except Exception as e:
                    found = None if errors is None else _translated(errors, e, shown, args, kwargs)
                    if found is None:
                        raise
                    raise found from None

        params = [p for p in shown.parameters.values() if p.name != "region"]
        call.__signature__ = shown.replace(parameters=params)  # type: ignore[attr-defined]
        call._fop_region = region  # type: ignore[attr-defined]
        call._fop_named = True  # type: ignore[attr-defined]
        return call

    return decorate


def _translated(
    errors: Errors, error: Exception, shown: inspect.Signature, args: tuple, kwargs: dict
) -> BaseException | None:
    """What ``errors`` makes of ``error`` (None: it stands, also where the translation
    itself fails)."""
    try:
        return errors(error, shown.bind_partial(*args, **kwargs).arguments)
    except Exception:  # noqa: BLE001  (the original error stands)
        return None


def _decorator(region: Callable[..., contextlib.AbstractContextManager]) -> Callable:
    """The wrapper of :func:`collective_method`: the body called in ``region(...)``'s
    region, handed it as ``region=``; the signature shown is the body's without it."""

    def decorate(body: Callable) -> Callable:
        @functools.wraps(body)
        def call(*args: Any, **kwargs: Any) -> Any:
            with region(*args, **kwargs) as drawn:
                return body(*args, region=drawn, **kwargs)

        shown = inspect.signature(body)
        params = [p for p in shown.parameters.values() if p.name != "region"]
        call.__signature__ = shown.replace(parameters=params)  # type: ignore[attr-defined]
        call._fop_region = region  # type: ignore[attr-defined]
        return call

    return decorate


@contextlib.contextmanager
def resumed(region: Region | None) -> Iterator[None]:
    """Runs the body as a part of the operation of ``region`` (its activity named in the
    heartbeat; e.g. a save's write and commit on a background thread, which hands
    ``region`` down itself); an error leaving the body is published. ``None``:
    nothing."""
    if region is None:
        yield
        return
    try:
        with ACTIVITIES.doing(f"{region.kind} (operation {region.tag})"):
            yield
    except (SystemExit, GeneratorExit):  # a preempted run leaves together, on purpose
        raise
    except BaseException as e:
        publish_failure(region, e)
        raise


def publish_failure(region: Region, error: BaseException) -> None:
    """Publishes ``error`` as this process's failure in ``region`` (once more with a
    later error: the last one stays). A service already gone is no news to the others."""
    record = _record(region, error)
    CALLS["kv_set"] += 1
    key = f"{FAILED}/{region.tag}/{jax.process_index()}"
    try:
        client().key_value_set(key, json.dumps(record), allow_overwrite=True)
    except Exception:  # noqa: BLE001  (the error itself is raised on this process)
        pass


def announce_agreement(op: str, error: BaseException, region: Region | None) -> None:
    """Before an agreement (``distributed.agree``) at which this process brings
    ``error``: says so in the region, so that a process waiting elsewhere, which this
    one will never meet there (it left the path where the others wait), raises rather
    than waits; one at the same agreement, or past it, reads on (a recoverable failure:
    the others learn it at the agreement)."""
    if region is not None and jax.process_count() > 1:
        number = int(op.rsplit(".", 1)[1])
        record = {**_record(region, error), "agreement": op, "number": number}
        CALLS["kv_set"] += 1
        key = f"{FAILED}/{region.tag}/{jax.process_index()}/at/{number}"
        client().key_value_set(key, json.dumps(record), allow_overwrite=True)


def announce_leaving(error: BaseException, *, scope: str | None, where: str) -> None:
    """Says that this process leaves ``scope`` (a manager's operations: see
    :class:`Region`) with ``error``, raised out of ``where`` (e.g. the manager's ``with``
    block) once its own save in flight ended: it sets no more values there, so another
    process waiting in that scope for one of its values raises
    :class:`ProcessFailedError` within a slice (:func:`raise_if_left`) rather than at
    its stall timeout. A new manager is a new scope: a run that goes on after an error
    every process shared (and left together) is not affected."""
    if scope is None or jax.process_count() == 1:
        return
    record = {**_record(Region(where, scope), error), "kind": where}
    CALLS["kv_set"] += 1
    with contextlib.suppress(Exception):  # a service gone: the others learn of it anyway
        key = f"{LEFT}/{scope}/{jax.process_index()}"
        client().key_value_set(key, json.dumps(record), allow_overwrite=True)


def raise_if_left(process: int, key: str, region: Region | None) -> None:
    """Raises :class:`ProcessFailedError` when ``process`` announced that it left the
    scope of ``region``, the waiting operation's (:func:`announce_leaving`; outside a
    manager's scope, :data:`PROGRAM`: its program ended) and ``key``, its value this
    wait is for, is not set: it never will be. Any thread."""
    scope = PROGRAM if region is None or region.scope is None else region.scope
    c = client()
    CALLS["failure_check"] += 1
    try:
        said = c.key_value_try_get(f"{LEFT}/{scope}/{process}")
    except Exception:  # noqa: BLE001  (NOT_FOUND: it did not leave)
        return
    try:
        c.key_value_try_get(key)  # set before it left: read on
        return
    except Exception:  # noqa: BLE001
        pass
    r = failure_record(said)
    where = "waiting" if region is None else region.kind
    error = ProcessFailedError(
        f"process {jax.process_index()} of {jax.process_count()}, in {where}: "
        f"process {process} left {r['kind']} with {r['type']}: {r['message']}"
    )
    error.process, error.error_type = process, r["type"]
    raise error


def _diverged(region: Region, r: dict[str, Any], waiting_for: int | None) -> bool:
    """Whether a published record of another process ends the waits in ``region``: a
    failure leaving the region, or an agreement the region is not at and never went
    through, of the process it waits for (which waits there instead), or past which the
    region has already drawn names."""
    op = r["agreement"]
    if op is None:
        return True
    if op == region.agreeing or op in region.agreed:
        return False
    return r["process"] == waiting_for or r["number"] < region.drawn


def _record(region: Region, error: BaseException) -> dict[str, Any]:
    return {
        "process": jax.process_index(),
        "kind": region.kind,
        "type": type(error).__name__,
        "message": str(error)[:4000],
        "derived": isinstance(error, ProcessFailedError),
        "agreement": None,
        "number": -1,
    }


def raise_published_failure(region: Region | None, waiting_for: int | None = None) -> None:
    """Raises :class:`ProcessFailedError` when another process published a failure in
    ``region``, the waiting operation's (an own failure first, before one that was only
    learnt; None: nothing); ``waiting_for``: the process whose value it waits for."""
    if region is None or jax.process_count() == 1:
        return
    CALLS["failure_check"] += 1
    try:
        found = client().key_value_dir_get(f"{FAILED}/{region.tag}/")
    except Exception:  # noqa: BLE001  (a service gone: the wait itself reports it)
        return
    records = [failure_record(value) for _, value in found]
    me = jax.process_index()
    records = [r for r in records if r["process"] != me and _diverged(region, r, waiting_for)]
    if records:
        r = min(records, key=lambda r: (r["derived"], r["process"]))
        error = ProcessFailedError(
            f"process {jax.process_index()} of {jax.process_count()}, in {region.kind}: "
            f"process {r['process']} failed in {r['kind']}: {r['type']}: {r['message']}"
        )
        error.process, error.error_type = r["process"], r["type"]
        raise error


def failure_record(text: str) -> dict[str, Any]:
    """A published failure (this module's own JSON), every field present."""
    try:
        raw = json.loads(text)
        return {
            "process": int(raw["process"]),
            "kind": str(raw["kind"]),
            "type": str(raw["type"]),
            "message": str(raw["message"]),
            "derived": bool(raw["derived"]),
            "agreement": None if raw.get("agreement") is None else str(raw["agreement"]),
            "number": int(raw.get("number", -1)),
        }
    except (ValueError, KeyError, TypeError):
        return {
            **{"process": -1, "kind": "?", "type": "?", "message": text[:4000]},
            **{"derived": False, "agreement": None, "number": -1},
        }


def fault_point(region: Region | None) -> None:
    """Before each coordination call: the fault point of ``region``'s kind
    (``FOP_FAIL_AT=collective-<kind>[:N]``, see ``_base.env``; None: none)."""
    if region is not None:
        _env.fail_point(f"collective-{region.kind}")
