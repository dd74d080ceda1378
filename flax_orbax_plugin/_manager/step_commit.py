"""StepBook: what one CheckpointManager knows about its steps, under one lock.

The committed steps of a writer (a list in memory, so that a save costs the same
whatever the number of steps kept), the steps being read (never deleted by this
manager's retention) and being deleted (never read), the metrics of each step for
``keep_best`` (``{name: value}``), when this manager saved each step and in which lane
(``KeepFor``, ``Lanes``), the figures of the last save, the persistent tier if any, and
where events go.

Threading: the training thread, the save's background thread and the deletion
thread all use one book; every field is read and changed under its lock.

StepCommit: the one commit of a manager's step, once its items are written.

Every item of a step is written into the step's staging directory without a commit
of its own; when every process has made its files durable (``write``), the primary
writes the manifest and commits the step once (``publish``: rename on filesystems,
the manifest as the marker on object stores); a failure anywhere removes what this
save wrote (``abort``), never the step it was replacing. The collective protocol
is ``_core.save.commit_collectively``; this module supplies the three steps.

Threading: built on the training thread, :meth:`StepCommit.run` on the save's
background thread (every process runs it, with the same operation id).
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .._base import distributed as _distributed
from .._base import env as _env
from .._base.env import found
from .._core import handle as _handle
from .._core import ownership as _ownership
from .._core import save as _save
from .._core.formats import SaveRequest, Written
from .._core.handle import raise_if_cancelled
from .._core.plan import structure_lines
from .._core.save import SaveResult, Staging
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import steps as _steps
from .._format.layout import MANIFEST_FILE
from .._format.layout.records import LANES
from .._format.steps import ItemEntry, StepManifest
from .._storage.location import Location
from .checkpointables import Checkpointable, Pending
from .events import Events, measure_stored
from .per_host import HOST_FILE
from .tiers import PersistentTier

__all__ = [
    "StepBook",
    "StepCommit",
    "abort_refused",
    "abort_staged",
    "checked_written",
    "start_item",
    "wait_all",
]


class StepBook:
    """The step records of the manager on ``location`` (see the module docstring), built
    once the writer's open resolved the opened ``tier``, ``per_host`` (see per_host), the
    ``run`` owning the places (each host's marker names it) and the ``writer``'s lock or
    lease (a reader: none of them); ``events``: where every collaborator's go."""

    def __init__(
        self,
        location: Location,
        events: Events,
        *,
        tier: PersistentTier | None = None,
        per_host: bool = False,
        run: str | None = None,
        writer: Any = None,
    ):
        self.location = location
        self.events = events
        self.tier, self.per_host, self.run, self.writer = tier, per_host, run, writer
        self.lock = threading.Lock()  # guards the fields below
        self._reading: collections.Counter[int] = collections.Counter()
        self._deleting: set[int] = set()
        self._metrics: dict[int, dict[str, float | None]] = {}
        self._times: dict[int, float] = {}  # step -> when this manager saved it (its clock)
        self._lanes: dict[int, str | None] = {}  # step -> the lane it was saved in
        self._committed: list[int] | None = None  # a writer's committed steps (steps())
        self._last_save: SaveResult | None = None

    # -- committed steps

    def listed(self) -> list[int]:
        """Committed steps, ascending (steps being deleted are left out), as listed in
        the store now. A save never calls it: see :meth:`known`."""
        steps = _steps.committed_steps(self.location)
        with self.lock:
            return [s for s in steps if s not in self._deleting]

    def latest(self, *, include_persistent: bool) -> int | None:
        """The highest listed step; with ``include_persistent``, of either tier."""
        steps = self.listed()
        if include_persistent and self.tier is not None:
            steps = sorted(set(steps) | set(self.tier.steps()))
        return steps[-1] if steps else None

    def known(self) -> list[int]:
        """A writer's committed steps, from its list in memory (steps being deleted left
        out): what ``save`` and retention use, so that a save costs the same whatever
        the number of steps kept. Listed from the store at the first need and again
        after a failed commit (or anything else that makes it unsure); kept up to date
        by this manager's own commits and removals. Any thread."""
        with self.lock:
            known = self._committed
        if known is None:
            listed = _steps.committed_steps(self.location)
            with self.lock:
                if self._committed is None:
                    self._committed = listed
                known = self._committed
        with self.lock:
            return [s for s in known if s not in self._deleting]

    def forget(self) -> None:
        """The list in memory may be wrong (a failed commit, a removal by someone
        else, a copy from the persistent tier): the next need lists the store."""
        with self.lock:
            self._committed = None

    def committed(self, step: int, result: SaveResult, metric: dict[str, float | None]) -> None:
        """Background thread, after ``step``'s commit: it joins the list."""
        with self.lock:
            if self._committed is not None and step not in self._committed:
                bisect.insort(self._committed, step)
        with self.lock:
            self._metrics[step] = metric
            self._last_save = result

    def removed(self, step: int) -> None:
        with self.lock:
            self._times.pop(step, None)
            self._lanes.pop(step, None)
            if self._committed is not None and step in self._committed:
                self._committed.remove(step)

    @property
    def last_save(self) -> SaveResult | None:
        with self.lock:
            return self._last_save

    # -- reading and deleting

    def begin_read(self, step: int) -> None:
        """``step`` is being read (not deleted meanwhile); pair with :meth:`end_read`."""
        with self.lock:
            if step in self._deleting:
                raise CheckpointNotFoundError(f"step {step} of {self.location} is being deleted")
            self._reading[step] += 1

    def end_read(self, step: int) -> None:
        with self.lock:
            self._reading[step] -= 1

    def being_read(self) -> set[int]:
        with self.lock:
            return set(+self._reading)

    def begin_delete(self, step: int) -> bool:
        """False when ``step`` is being read; else it is being deleted until
        :meth:`end_delete`."""
        with self.lock:
            if self._reading[step] > 0:
                return False
            self._deleting.add(step)
            return True

    def end_delete(self, step: int) -> None:
        with self.lock:
            self._deleting.discard(step)
            self._metrics.pop(step, None)

    # -- metrics (keep_best)

    def metric(self, step: int) -> tuple[bool, dict[str, float | None]]:
        """``(known, {name: value})``: whether ``step``'s metrics are known, and them."""
        with self.lock:
            if step in self._metrics:
                return True, self._metrics[step]
        return False, {}

    def set_metric(self, step: int, value: dict[str, float | None]) -> None:
        with self.lock:
            self._metrics[step] = value

    # -- save times and lanes (KeepFor, Lanes)

    def note_save(self, step: int, when: float, lane: str) -> None:
        """Training thread, as ``step``'s save begins: its time (the schedule's, the
        primary's with several processes when time matters) and its lane."""
        with self.lock:
            self._times[step] = when
            self._lanes[step] = lane

    def note_lane(self, step: int, lane: str | None) -> None:
        """Any thread: the lane an earlier run recorded for ``step`` (its manifest; None:
        it recorded none, and its number says)."""
        with self.lock:
            self._lanes.setdefault(step, lane)

    def lane_of(self, step: int) -> str | None:
        """The lane ``step`` was saved in (None: not known)."""
        with self.lock:
            return self._lanes.get(step)

    def dated(self) -> tuple[dict[int, float], dict[int, str | None]]:
        """``(times, lanes)`` of the steps this manager saved (copies)."""
        with self.lock:
            return dict(self._times), dict(self._lanes)


logger = logging.getLogger("flax_orbax_plugin")


def wait_all(pendings: Iterable[Pending], *, raise_first: bool = False) -> list[Any]:
    """Waits for every pending write (even after one failed: none stays in flight)."""
    results, first = [], None
    for p in pendings:
        try:
            results.append(p.wait())
        except BaseException as e:  # noqa: BLE001
            results.append(None)
            first = first or e
    if raise_first and first is not None:
        raise first
    return results


def start_item(
    name: str, handler: Checkpointable, directory: Location, value: Any, request: SaveRequest
) -> Pending:
    """``handler.save(...)`` of item ``name``, its return checked: a Pending (an object
    with ``wait()``), else CheckpointError naming the item (not an AttributeError later,
    from the background thread, after ``save`` returned True)."""
    pending = handler.save(directory, value, request)
    if not callable(getattr(pending, "wait", None)):
        raise CheckpointError(
            f"item {name!r}: {type(handler).__name__}.save returned {found(pending)}; "
            f"a checkpointable's save must return a Pending (an object with wait())"
        )
    return pending


def checked_written(name: str, result: Any) -> Written | None:
    """What item ``name``'s ``Pending.wait()`` returned: a Written or None, else
    CheckpointError naming the item (its files would go unlisted, unchecked)."""
    if result is not None and not isinstance(result, Written):
        raise CheckpointError(
            f"item {name!r}: Pending.wait() returned {found(result)}; expected "
            f"fop.Written(bytes_written, files) or None"
        )
    return result


class StepCommit:
    """Commits ``step`` of ``location`` from ``staging`` once ``pendings`` are written.

    ``entries``: the manifest's item entries; ``digest``: the tree structure every
    process must agree on; ``replace``: the step exists and is being replaced."""

    def __init__(
        self,
        location: Location,
        step: int,
        staging: Staging,
        pendings: Mapping[str, Pending],
        entries: Mapping[str, ItemEntry],
        digest: str,
        replace: bool,
        *,
        host_marker: bytes | None = None,
        cancelled: threading.Event | None = None,
        writer: Any = None,
        lane: str | None = None,
    ):
        self._loc = location
        self._step = step
        self._staging = staging
        self._pendings = pendings
        self._entries = entries
        self._digest = digest
        self._replace = replace
        # Each host's own directory: this host's marker, written before the sync; every
        # process commits its own copy with the primary's manifest (see per_host).
        self._host_marker = host_marker
        self._cancelled = cancelled or threading.Event()  # set: the save was interrupted
        self._writer = writer  # the manager's lock or lease: held still (before_commit)?
        self._lane = lane if lane in LANES else None  # recorded in the manifest (Lanes)
        self._op, self._region = "", None  # the commit's names and region: run's
        self._sizes: list[Written] = []  # this process's totals, for the manifest
        self._old_dirs: set[str] = set()  # object stores: the replaced step's item dirs
        # (files, bytes) of the committed step as stored, counted by the process that
        # committed it (the primary; each host its own copy); None elsewhere.
        self.stored: tuple[int, int | None] | None = None

    def run(self, op: str, region: _distributed.Region | None) -> Written:
        """Background thread: every item written and durable, then the one commit, named
        ``op``, in ``region`` (the manager save's: ``_base.regions``)."""
        staging = self._staging
        if self._replace and not staging.renames and _distributed.is_primary():
            old = _steps.read_manifest(staging.final)
            self._old_dirs = {e.dir for e in old.items.values()}
        self._op, self._region = op, region
        written = _save.commit_collectively(
            op,
            what=f"step {self._step} of {self._loc}",
            step=self._step,
            digest=self._digest,
            write=self._write,
            publish=self._publish,
            abort=self._abort,
            structure=self._structure,
            region=region,
        )
        if self._host_marker is not None and _distributed.process_count() > 1:
            self._commit_own_copies(op)
        return written

    def _structure(self) -> list[str]:
        """The step's items and their leaves in words (``commit_collectively``)."""
        out = []
        for name, pending in self._pendings.items():
            snap = getattr(pending, "snap", None)
            lines = (
                [f": {self._entries[name].kind}"]
                if snap is None
                else [f"/{line}" for line in structure_lines(snap.leaves)]
            )
            out.extend(name + line for line in lines)
        return out

    def _commit_own_copies(self, op: str) -> None:
        """Each host's own directory, once the primary committed its copy: every other
        process commits its own with the primary's manifest and reports it; the primary
        returns (and the tier replicates the step) only once every host's copy is
        committed, else raises naming the hosts."""
        if _distributed.is_primary():
            failed = []
            for p in range(1, _distributed.process_count()):
                report = _distributed.get_from(f"{op}/local", p, region=self._region)
                if report != "ok":
                    failed.append(f"process {p}: {report}")
            if failed:
                raise CheckpointError(
                    f"step {self._step} of {self._loc} is committed on process 0 but not "
                    f"in every host's own directory: " + "; ".join(failed)
                )
            return
        raw = _distributed.broadcast_str(f"{op}/manifest", None, region=self._region)
        try:  # the primary committed its copy: this host commits its own
            self._staging.publish(MANIFEST_FILE, raw.encode(), replace=True)
            self.stored = measure_stored(self._staging.final)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            _distributed.publish(f"{op}/local", error, region=self._region)
            self._abort()
            raise
        _distributed.publish(f"{op}/local", "ok", region=self._region)

    def _write(self) -> Written:
        total, files, reused = 0, {}, 0
        results = wait_all(self._pendings.values(), raise_first=True)
        raise_if_cancelled(self._cancelled, f"step {self._step} of {self._loc}")
        for name, result in zip(self._pendings, results, strict=True):
            if checked_written(name, result) is not None:
                total += result.bytes_written
                reused += result.bytes_reused
                d = self._entries[name].dir
                files.update({f"{d}/{f}": h for f, h in result.files.items()})
        if self._host_marker is not None:
            self._check_own_items()
            self._staging.location.write_bytes(HOST_FILE, self._host_marker, durable=False)
        self._staging.location.sync()
        _env.kill_point("after_sync")
        self._sizes.append(Written(total, files, reused))
        return self._sizes[-1]

    def _check_own_items(self) -> None:
        """Each host's own directory: every item wrote something into this host's copy
        (a custom checkpointable that writes only on process 0 would leave the other
        hosts' copies without it: they could not restore the step on their own)."""
        where = self._staging.location
        empty = [n for n, e in self._entries.items() if not where.child(e.dir).list_children()]
        if empty:
            names = ", ".join(repr(n) for n in sorted(empty))
            raise CheckpointError(
                f"step {self._step} of {self._loc}: checkpointable {names} wrote nothing into "
                f"process {_distributed.process_index()}'s own directory; with a directory "
                f"per host every process must write every item (write on every process, "
                f"not only on process 0), or use a directory every host shares"
            )

    def _publish(self, files: dict[str, str]) -> None:
        raise_if_cancelled(self._cancelled, f"step {self._step} of {self._loc}")
        count = _distributed.process_count()
        # Sizes only where this process wrote it all (others' totals are not here).
        mine = self._sizes[0] if count == 1 and self._sizes else None
        manifest = StepManifest(
            self._step,
            self._entries,
            files,
            count,
            time.time(),
            self._digest,
            None if mine is None else mine.bytes_written,
            None if mine is None else mine.bytes_reused,
            self._lane,
        )
        staging = self._staging
        raw = manifest.to_bytes()
        if self._host_marker is not None and _distributed.process_count() > 1:
            _distributed.broadcast_str(f"{self._op}/manifest", raw.decode(), region=self._region)
        if self._writer is not None:  # a lease lost meanwhile: nothing committed
            self._writer.before_commit()
        staging.publish(MANIFEST_FILE, raw, replace=True)
        if not staging.renames and self._old_dirs:
            fresh = {e.dir for e in self._entries.values()}
            _ownership.remove_children(  # the replaced step's own item directories
                staging.final, sorted(self._old_dirs - fresh), action="clean up the replaced"
            )
        self.stored = measure_stored(staging.final)

    def _abort(self) -> None:
        abort_staged(self._staging, self._replace, {n: e.dir for n, e in self._entries.items()})


def abort_refused(staging: Staging, replace: bool, dirs: Mapping[str, str]) -> None:
    """:func:`abort_staged` for a save refused in its blocking phase (training thread):
    the refusal stays the error; a removal that fails is a WARNING (the next writer's
    open or ``gc()`` removes what this save staged, proven ours by its claim)."""
    try:
        abort_staged(staging, replace, dirs)
    except Exception as e:  # noqa: BLE001  (the refusal is the error)
        logger.warning(
            "checkpoint: a save into %s was refused, and removing what it staged failed "
            "(%s: %s); the next writer's open or gc() removes it",
            staging.final,
            type(e).__name__,
            e,
        )


def abort_staged(staging: Staging, replace: bool, dirs: Mapping[str, str]) -> None:
    """Removes what one save staged and nothing else, on every store: its staging
    directory (filesystems); on object stores, which write in place, the new step under
    this save's own claim, or, where it replaces a committed step (``replace``), only
    the new items' fresh directories (``dirs``: item name -> directory) and this save's
    claim, the old step left whole. Called by the commit's abort (background) and by a
    save refused in its blocking phase (training thread), which stages no less."""
    if staging.renames:
        _ownership.remove_staging(staging.location, staging.nonce)
    elif not replace:  # a new step written in place: no manifest, all of it goes
        if _handle.holds_nonce(staging.final, staging.nonce):  # under its own claim only
            _ownership.remove_if_ours(staging.final, what="uncommitted step")
    else:  # the old step stays whole: only the new items' fresh directories go
        fresh = [d for n, d in dirs.items() if d != n]
        _ownership.remove_children(staging.final, fresh, action="abort the save into")
        if _handle.holds_nonce(staging.final, staging.nonce):  # its commit record proves it
            _ownership.unclaim(staging.final)
