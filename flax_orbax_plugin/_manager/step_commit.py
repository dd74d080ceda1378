"""StepCommit: the one commit of a manager's step, once its items are written.

Every item of a step is written into the step's staging directory without a commit
of its own; when every process has made its files durable (``write``), the primary
writes the manifest and commits the step once (``publish``: rename on filesystems,
the manifest as the marker on object stores); a failure anywhere removes what this
save wrote (``abort``), never the step it was replacing. The collective protocol
is ``_core.commit.commit_collectively``; this module supplies the three steps.

Threading: built on the training thread, :meth:`StepCommit.run` on the save's
background thread (every process runs it, with the same operation id).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .._base import distributed as _distributed
from .._base import env as _env
from .._base.env import found
from .._core import commit as _commit
from .._core import handle as _pending
from .._core import ownership as _ownership
from .._core.commit import Staging, Written
from .._core.formats import SaveRequest
from .._core.handle import raise_if_cancelled
from .._core.plan import structure_lines
from .._errors import CheckpointError
from .._format import steps as _steps
from .._format.layout import MANIFEST_FILE, ItemEntry, StepManifest
from .._format.layout.files import LANES
from .._storage.location import Location
from .checkpointables import Checkpointable, Pending
from .events import measure_stored
from .per_host import HOST_FILE

__all__ = [
    "StepCommit",
    "abort_refused",
    "abort_staged",
    "checked_written",
    "start_item",
    "wait_all",
]

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
        written = _commit.commit_collectively(
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
        if _pending.holds_nonce(staging.final, staging.nonce):  # under its own claim only
            _ownership.remove_if_ours(staging.final, what="uncommitted step")
    else:  # the old step stays whole: only the new items' fresh directories go
        fresh = [d for n, d in dirs.items() if d != n]
        _ownership.remove_children(staging.final, fresh, action="abort the save into")
        if _pending.holds_nonce(staging.final, staging.nonce):  # its commit record proves it
            _ownership.unclaim(staging.final)
