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

import time
from collections.abc import Iterable, Mapping
from typing import Any

from .._base import distributed as _distributed
from .._base import faults as _faults
from .._core import commit as _commit
from .._core import ownership as _ownership
from .._core.commit import Staging, Written
from .._format import steps as _steps
from .._format.layout import MANIFEST_FILE, ItemEntry, StepManifest
from .._storage.location import Location
from .checkpointables import Pending

__all__ = ["StepCommit", "wait_all"]


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
    ):
        self._loc = location
        self._step = step
        self._staging = staging
        self._pendings = pendings
        self._entries = entries
        self._digest = digest
        self._replace = replace
        self._sizes: list[Written] = []  # this process's totals, for the manifest
        self._old_dirs: set[str] = set()  # object stores: the replaced step's item dirs

    def run(self, op: str) -> Written:
        """Background thread: every item written and durable, then the one commit."""
        staging = self._staging
        if self._replace and not staging.renames and _distributed.is_primary():
            old = _steps.read_manifest(staging.final)
            self._old_dirs = {e.dir for e in old.items.values()}
        return _commit.commit_collectively(
            op,
            what=f"step {self._step} of {self._loc}",
            step=self._step,
            digest=self._digest,
            write=self._write,
            publish=self._publish,
            abort=self._abort,
        )

    def _write(self) -> Written:
        total, files, reused = 0, {}, 0
        results = wait_all(self._pendings.values(), raise_first=True)
        for name, result in zip(self._pendings, results, strict=True):
            if isinstance(result, Written):
                total += result.bytes_written
                reused += result.bytes_reused
                d = self._entries[name].dir
                files.update({f"{d}/{f}": h for f, h in result.files.items()})
        self._staging.location.sync()
        _faults.kill_point("after_sync")
        self._sizes.append(Written(total, files, reused))
        return self._sizes[-1]

    def _publish(self, files: dict[str, str]) -> None:
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
        )
        staging = self._staging
        staging.publish(MANIFEST_FILE, manifest.to_bytes(), replace=True)
        if not staging.renames and self._old_dirs:
            fresh = {e.dir for e in self._entries.values()}
            _ownership.remove_children(  # the replaced step's own item directories
                staging.final, sorted(self._old_dirs - fresh), action="clean up the replaced"
            )

    def _abort(self) -> None:
        staging = self._staging
        if staging.renames:
            _ownership.remove_staging(staging.location, staging.nonce)
        elif not self._replace:  # a new step written in place: no manifest, all of it goes
            _ownership.remove_if_ours(staging.final, what="uncommitted step")
        else:  # the old step stays whole: only the new items' fresh directories go
            fresh = [e.dir for n, e in self._entries.items() if e.dir != n]
            _ownership.remove_children(staging.final, fresh, action="abort the save into")
