"""Saving a pytree (``fop.save``): the blocking snapshot, the background write, the commit.

Call order, on every process (all save the same tree in the same order): :func:`snapshot`
(the caller's thread; it may then donate the arrays); :meth:`Snapshot.write` (a
background thread); then :func:`commit_collectively` (the same thread, two key-value
rounds) makes the checkpoint visible whole or not at all. One save_async runs at a time.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.save``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .._base import distributed as _distributed
from .._base import env as _env
from .._base import host as _host
from .._base import interrupts as _interrupts
from .._base import tree as _tree
from .._base.distributed import public
from .._errors import CheckpointError, CoordinationError, SaveCancelledError
from .._format.layout import COMMIT_FILE, CommitMarker
from .._storage.location import Location
from .._storage.store_errors import arguments, refusals
from . import commit_rounds as _rounds
from . import ownership as _ownership
from . import removing as _removing
from . import writer_liveness as _liveness
from .formats import DEFAULT_FORMAT_VERSION, SaveRequest, Written, check_save
from .handle import Cancellation, SaveHandle, SaveResult, raise_if_cancelled
from .plan import Plan, Snapshot

logger = logging.getLogger("flax_orbax_plugin")


@dataclasses.dataclass(frozen=True)
class Staging:
    """Where one commit writes (``location``) and where it appears (``final``)."""

    final: Location
    location: Location
    nonce: str
    own: bool = False  # this process's own copy (a host's own directory): it claims it

    @property
    def renames(self) -> bool:
        return self.location != self.final

    @classmethod
    def begin(
        cls, final: Location, nonce: str, *, claim: bool = True, own: bool = False
    ) -> Staging:
        """The staging of a commit of ``final`` (one ``nonce`` on every process)."""
        place = final.sibling(f"{final.name}.partial-{nonce}") if final.supports_rename else final
        staging = cls(final, place, nonce, own)
        if claim:
            staging.claim()
        return staging

    def claim(self, *, fresh: bool = False) -> None:
        """The primary's (or an own place's) claim; ``fresh``: a save that replaces nothing."""
        if self.own or _distributed.is_primary():
            _ownership.claim(self.location, self.nonce, fresh=fresh)

    def publish(self, marker: str, data: bytes, *, replace: bool) -> None:
        """Primary only: writes the marker last and makes the checkpoint visible."""
        self.location.write_bytes(marker, data)  # durable (file and directory fsynced)
        _env.kill_point("after_marker")
        try:  # the marker now proves it ours (a crash: a committed .partial-)
            _ownership.unclaim(self.location)
        except Exception as e:  # noqa: BLE001  (a store refusing DELETE: committed all the same)
            logger.warning(
                "checkpoint: %s is committed, but its pending marker could not be removed "
                "(%s: %s); it is left inside, harmless",
                self.location,
                type(e).__name__,
                e,
            )
        if not self.renames:
            return
        # an empty directory at the final name holds nothing to lose (rmdir: if empty)
        if not self.final.is_dir() or _ownership.rmdir_if_empty(self.final):
            self.location.rename(self.final)
            self._remove_stale_siblings()
            return
        if not replace:
            raise CheckpointError(f"{self.final} was created by someone else meanwhile")
        _ownership.require_ours(self.final, action="replace")
        old = self.final.sibling(f"{self.final.name}.deleting-{self.nonce}")
        if self.location.exchange(self.final):  # one atomic swap: no window without it
            _env.kill_point("mid_rename")
            self.location.rename(old)  # the old one, now at the staging name
        else:
            self.final.rename(old)  # no exchange here: a crash now leaves a complete
            _env.kill_point("mid_rename")  # .partial- that the next writer rolls forward
            self.location.rename(self.final)
        _ownership.remove(old, action="remove the replaced")
        self._remove_stale_siblings()

    def _remove_stale_siblings(self) -> None:
        """After a commit: dead stagings of earlier saves of the same name go."""
        parent = self.final.parent
        prefixes = (f"{self.final.name}.partial-", f"{self.final.name}.deleting-")
        for name, kind in parent.child_kinds().items():
            if (
                kind == "dir"
                and name.startswith(prefixes)
                and _liveness.is_dead(parent.child(name))
            ):
                _removing.remove_leftover(parent.child(name), what="stale staging")

    def abort(self) -> None:
        if self.renames:
            _removing.remove_staging(self.location, self.nonce)


def commit_collectively(
    op: str,
    *,
    what: str,
    step: int | None,
    digest: str,
    write: Callable[[], Written],
    publish: Callable[[dict[str, str]], None],
    abort: Callable[[], None],
    agreed: dict[str, Any] | None = None,
    structure: Callable[[], list[str]] | None = None,
    region: _distributed.Region,
) -> Written:
    """The protocol of the module docstring; ``publish(files)`` runs on the primary alone.
    Raises this process's error, CoordinationError (disagreement), CheckpointError (another's)."""
    error: BaseException | None = None
    written = Written()
    try:
        written = write()
    except BaseException as e:  # noqa: BLE001  (reported to every process below)
        error = e
    failed = None if error is None else f"{type(error).__name__}: {error}"
    mine = {"step": step, "digest": digest, "agreed": agreed or {}, "error": failed}
    status = json.dumps({**mine, "files": written.files})
    if _distributed.is_primary():
        outcome = _primary_round(op, status, publish, abort, structure, region)
    else:
        outcome = _rounds.other_round(op, status, abort, structure, region)
    if error is not None:
        error.add_note(f"{what}: {outcome}")
        raise error
    if outcome.startswith(("disagree", "lost")):
        raise CoordinationError(f"{what} not committed: {outcome}")
    if outcome.startswith(CANCELLED):
        raise SaveCancelledError(f"{what} {outcome}")
    if outcome != "committed":
        raise CheckpointError(f"{what} failed: {outcome}")
    return written


def _primary_round(op, own_status, publish, abort, structure, region) -> str:
    """The primary reads every status, commits or discards, then tells the outcome."""
    try:
        statuses = [json.loads(own_status)]
        for p in range(1, _distributed.process_count()):
            statuses.append(json.loads(region.get_from(f"{op}/status", p)))
        # one process: one status, nothing to disagree with
        outcome = _rounds.disagreement(statuses) if len(statuses) > 1 else None
        errors = [(p, s["error"]) for p, s in enumerate(statuses) if s["error"]]
        if outcome is None and errors:  # cancelled when every failure is an agreed abort
            cancelled = all(e.startswith(f"{SaveCancelledError.__name__}:") for _, e in errors)
            head = CANCELLED if cancelled else "not committed; "
            outcome = head + "; ".join(f"process {p}: {e}" for p, e in errors)
        if outcome is None:
            files = {name: sha for s in statuses for name, sha in s["files"].items()}
            _env.pause_point("before_commit")
            publish(files)
            outcome = "committed"
    except CoordinationError as e:  # a process is gone or late: nothing commits
        outcome = f"lost: not committed; {e}"
    except SaveCancelledError as e:  # the primary's own cancellation, at its last check
        outcome = f"{CANCELLED}process 0: {e}"
    except BaseException as e:  # noqa: BLE001  (every process learns of it)
        outcome = f"not committed; commit failed on the primary: {type(e).__name__}: {e}"
    if outcome != "committed":
        outcome = _rounds.discard(abort, outcome)
    if _distributed.process_count() > 1:
        differs = _rounds.STRUCTURE in outcome and structure is not None
        if differs:
            region.publish(f"{op}/structure", json.dumps(structure()))
        region.broadcast_str(f"{op}/outcome", outcome)
        if differs:
            outcome += _rounds.their_difference(op, outcome, structure(), region)
    return outcome


CANCELLED = "cancelled, not committed; "  # the outcome when only cancellations failed


_IN_FLIGHT_LOCK = threading.Lock()  # one save_async starts at a time


@public("save", errors=refusals(arguments("path")))  # the region handed as ``region=``
def save(
    path: Any,
    tree: Any,
    *,
    region: _distributed.Region,
    force: bool = False,
    memory_limit_bytes: int | None = None,
    compression: str | None = None,
    format_version: int | None = DEFAULT_FORMAT_VERSION,
    data_file_bytes: int | None = None,
    host_memory_budget: int | None = None,
):
    """Saves ``tree`` to ``path``; durable and committed on return.

    See ``fop.save_async`` (``_core.save_async``) for the arguments.
    """
    given = {k: v for k, v in locals().items() if k not in ("path", "tree", "region")}
    return start_save(path, tree, region, given).wait()


def start_save(path, tree, region: _distributed.Region, given: dict) -> SaveHandle:
    """``fop.save_async`` in ``region``; interrupted, the save is cancelled."""
    options = check_save(**given)
    force = options.pop("force")
    request = SaveRequest(region=region, **options)
    started: list[SaveHandle] = []
    try:
        return _start(path, tree, started, request, force=force)
    except BaseException:
        for handle in started:
            handle.abandon()
        raise


def _start(
    path, tree, started: list[SaveHandle], request: SaveRequest, *, force: bool
) -> SaveHandle:
    """The blocking phase; the handle goes to ``started`` once its background phase runs."""
    with _IN_FLIGHT_LOCK:
        _host.wait_for_pending_save()  # interruptible: nothing of this save exists yet
        # Ctrl-C held over the blocking phase (a JAX callback would drop it), raised at its end
        with _interrupts.deferred_sigint() as ctrl_c:
            start = time.perf_counter()
            location = Location.from_path(path)
            cancelled = Cancellation()  # the writes stop once it is set
            snap = snapshot(tree, request.replace(cancelled=cancelled))
            # a foreign or committed (without force) target refused; object stores: cleared later
            region = request.region
            held = _ownership.prepare_slot(
                location, what="a checkpoint", replace=force, clear=False, region=region
            )
            clear_first = held and not location.supports_rename
            name = region.unique_name()
            staging = Staging.begin(location, name, claim=False)
            job = _Background(
                snap=snap,
                staging=staging,
                op=region.next_operation_id("save"),
                region=region,
                clear_first=clear_first,
                force=force,
                start=start,
                blocking=time.perf_counter() - start,
                agreed={
                    "path": str(location),
                    "force": force,
                    "format_version": request.format_version,
                    "compression": request.compression,
                    "data_file_bytes": request.data_file_bytes,
                },
            )
            handle = SaveHandle(str(location), job.run, cancelled=cancelled, region=region)
            _host.in_flight(handle)
            handle.start(held=ctrl_c)  # a Ctrl-C held by now: it starts cancelled
            started.append(handle)
        wait_for_data(snap, handle)  # interruptible: the caller's except cancels
        return handle


@dataclasses.dataclass(frozen=True)
class _Background:
    """The background phase of one save (clear, write, commit), on the handle's thread."""

    snap: Snapshot  # its request's ``cancelled``: the handle's
    staging: Staging
    op: str
    region: _distributed.Region
    clear_first: bool
    force: bool
    start: float
    blocking: float
    agreed: dict[str, Any]  # what every process must save with (commit_collectively)

    def run(self) -> SaveResult:
        staging, cancelled = self.staging, self.snap.request.cancelled
        location = staging.final
        what = f"save to {location}"
        if self.clear_first:  # object store, no rename: start from an empty prefix
            if _distributed.is_primary():
                _ownership.remove(location, action="clear")
            self.region.barrier(f"{self.op}/cleared")

        def write() -> Written:
            raise_if_cancelled(cancelled, what)
            _env.pause_point("before_claim")  # tests: two saves racing for one place
            staging.claim(fresh=not self.force)  # before any data: remains provably ours
            written = self.snap.write(staging.location)
            raise_if_cancelled(cancelled, what)
            return written

        def publish(files: dict[str, str]) -> None:
            raise_if_cancelled(cancelled, what)
            marker = CommitMarker(files, time.time()).to_bytes()
            staging.publish(COMMIT_FILE, marker, replace=self.force)

        written = commit_collectively(
            self.op,
            what=what,
            step=None,
            digest=self.snap.digest,
            write=write,
            publish=publish,
            abort=self.abort,
            agreed=self.agreed,
            structure=lambda: _rounds.structure_lines(self.snap.leaves),
            region=self.region,
        )
        total = time.perf_counter() - self.start
        return SaveResult(str(location), self.blocking, total, written.bytes_written)

    def abort(self) -> None:
        """The failed save's staging goes (in place: under its own claim only)."""
        staging = self.staging
        staging.abort()
        if staging.renames or not _distributed.is_primary():
            return
        if _liveness.holds_nonce(staging.final, staging.nonce):
            _ownership.remove(staging.final, action="remove the remains of the failed save at")


def wait_for_data(snap: Snapshot | None, handle: SaveHandle) -> None:
    """A save holding views of the state (a budget): waits until its data is written."""
    if snap is None or not snap.write_first:
        return
    while not snap.data_written.wait(0.05):
        if handle.done():
            return


def snapshot(tree: Any, request: SaveRequest) -> Snapshot:
    """The blocking phase: ``tree``'s plan and this process's host copy."""
    with _tree.paused_gc():
        plan = Plan.build(tree, request)
    _env.pause_point("snapshot")
    snap = plan.snapshot()
    _env.kill_point("after_snapshot")
    return snap
