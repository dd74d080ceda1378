"""Staging and commit: how a checkpoint (a core pytree or a manager step) becomes visible
whole or not at all, once per commit (items inside a manager step have none of their own).

Run on the background save thread of every process, in the same order on each
(:func:`commit_collectively`: no barrier, two key-value rounds).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.commit``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from .._base import distributed as _distributed
from .._base import env as _env
from .._errors import CheckpointError, CoordinationError, SaveCancelledError
from .._storage.location import Location
from . import handle as _handle
from . import ownership as _ownership
from .formats import Written

logger = logging.getLogger("flax_orbax_plugin")
STALE_SECONDS = 3600.0  # a staging directory untouched this long belongs to a dead save


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
        """The staging place of a commit of ``final``, claimed (pending marker written)
        before anything else is written there (by the primary). Every process calls it
        with the same ``nonce``. With ``claim=False`` the caller calls :meth:`claim` itself, before
        its first write (the core save: in its background phase). ``own``: a place only this
        process sees (each host's own directory): every process claims and commits its own."""
        if final.supports_rename:
            staging = cls(final, final.sibling(f"{final.name}.partial-{nonce}"), nonce, own)
        else:
            staging = cls(final, final, nonce, own)
        if claim:
            staging.claim()
        return staging

    def claim(self, *, fresh: bool = False) -> None:
        """Primary only (a no-op elsewhere): the others share the place and its claim.
        A process that writes before the claim lands can at worst leave remains
        nothing proves ours: left alone, never a foreign place removed. ``fresh``: a
        save that replaces nothing (object stores: see ``ownership.claim``)."""
        if self.own or _distributed.is_primary():
            _ownership.claim(self.location, self.nonce, fresh=fresh)

    def publish(self, marker: str, data: bytes, *, replace: bool) -> None:
        """Primary only: writes the marker last and makes the checkpoint visible.

        A ``final`` that holds anything this library cannot prove it wrote is never
        replaced: ForeignEntryError, and the staged data is left for ``abort``."""
        self.location.write_bytes(marker, data)  # durable (file and directory fsynced)
        _env.kill_point("after_marker")
        self._unclaim()  # the marker now proves it ours (a crash: a committed .partial-)
        if not self.renames:
            return
        if not self.final.is_dir() or self._remove_if_empty(self.final):
            self.location.rename(self.final)
            self._remove_stale_siblings()
            return
        if not replace:
            raise CheckpointError(f"{self.final} was created by someone else meanwhile")
        _ownership.require_ours(self.final, action="replace")
        if self.location.exchange(self.final):  # one atomic swap: no window without it
            _env.kill_point("mid_rename")
            old = self.location.sibling(f"{self.final.name}.deleting-{self.nonce}")
            self.location.rename(old)  # the old one, now at the staging name
            _ownership.remove(old, action="remove the replaced")
            self._remove_stale_siblings()
            return
        old = self.final.sibling(f"{self.final.name}.deleting-{self.nonce}")
        self.final.rename(old)  # no exchange here: a crash now leaves a complete
        _env.kill_point("mid_rename")  # .partial- that the next writer rolls forward
        self.location.rename(self.final)
        _ownership.remove(old, action="remove the replaced")
        self._remove_stale_siblings()

    def _unclaim(self) -> None:
        """The pending marker removed once the commit marker is written. A store that
        refuses the removal (a bucket policy allowing PUT, not DELETE) leaves it in a
        committed checkpoint, which the commit marker already proves whole: a WARNING,
        never a committed save reported as not committed."""
        try:
            _ownership.unclaim(self.location)
        except Exception as e:  # noqa: BLE001  (committed all the same)
            logger.warning(
                "checkpoint: %s is committed, but its pending marker could not be removed "
                "(%s: %s); it is left inside, harmless",
                self.location,
                type(e).__name__,
                e,
            )

    @staticmethod
    def _remove_if_empty(loc: Location) -> bool:
        """An empty directory at the final name (made by the user beforehand) holds
        nothing to lose: ``rmdir`` removes it only if it is still empty."""
        try:
            os.rmdir(loc.path.rstrip("/"))
        except OSError:
            return False
        return True

    def _remove_stale_siblings(self) -> None:
        """After a commit: staging left by earlier saves of the same name that died
        (``<name>.partial-*``, ``<name>.deleting-*``; real directories only, never
        through a link) is garbage. Only dead ones go (:func:`is_dead`), so a save of the
        same path still running in another job is never cut short."""
        parent = self.final.parent
        prefixes = (f"{self.final.name}.partial-", f"{self.final.name}.deleting-")
        for name, kind in parent.child_kinds().items():
            if kind == "dir" and name.startswith(prefixes) and is_dead(parent.child(name)):
                _ownership.remove_leftover(parent.child(name), what="stale staging")

    def abort(self) -> None:
        """Primary only: removes what this commit staged (renaming strategy)."""
        if self.renames:
            _ownership.remove_staging(self.location, self.nonce)


def is_dead(staging: Location) -> bool:
    """Staging (a real directory) of a save that no longer runs: the process named in
    its pending marker is gone (this host: see ``pending.writer_gone``), it names no
    writer and is unchanged for a while (``pending.abandoned``: empty, or committed, as a
    save killed between two renames leaves it), or nothing in it was touched for
    ``STALE_SECONDS`` (a writer on another host)."""
    if _handle.writer_gone(staging) or _handle.abandoned(staging):
        return True
    return time.time() - staging.newest_mtime() > STALE_SECONDS


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
    region: _distributed.Region | None,
) -> Written:
    """Runs the protocol in the module docstring; returns what this process wrote.

    ``write`` runs on every process (its own files, made durable); ``publish(files)``
    runs on the primary only, ``files`` merging every process's; ``abort()`` removes
    what was staged, on the primary and, after a failed outcome, on every process.
    ``agreed``: the options every process must have saved with (JSON values by name:
    the target path, the format...); a difference is a disagreement naming them.
    ``structure``: the tree's leaves in words (computed only when the structures
    differ: the primary publishes its own, each other process names the first leaf
    where its own differs). ``region``: the save's collective operation, whose names
    and failures its rounds use (``_base.regions``).
    Raises this process's own write error, or :class:`CoordinationError` when the
    processes disagree, or :class:`CheckpointError` when another process failed.
    """
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
        outcome = _primary_round(op, status, what, publish, abort, structure, region)
    else:
        outcome = _other_round(op, status, abort, structure, region)
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


def _primary_round(op, own_status, what, publish, abort, structure, region) -> str:
    """The primary's side: reads every status, commits (``publish``) or discards, then
    tells the outcome (a tree of another structure: after its own leaves)."""
    try:
        statuses = [json.loads(own_status)]
        for p in range(1, _distributed.process_count()):
            statuses.append(json.loads(_distributed.get_from(f"{op}/status", p, region=region)))
        outcome = _disagreement(statuses)
        if outcome is None:
            failed = [f"process {p}: {s['error']}" for p, s in enumerate(statuses) if s["error"]]
            outcome = (_failed_outcome(statuses) + "; ".join(failed)) if failed else None
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
        outcome = _discard(abort, outcome)
    if _distributed.process_count() > 1:
        differs = STRUCTURE in outcome and structure is not None
        if differs:
            _distributed.publish(f"{op}/structure", json.dumps(structure()), region=region)
        _distributed.broadcast_str(f"{op}/outcome", outcome, region=region)
        if differs:
            outcome += _their_difference(op, outcome, structure(), region)
    return outcome


def _other_round(op, status, abort, structure, region) -> str:
    """Another process's side: publishes its status, reads the outcome (waiting longer
    than the primary may spend on one status, so a missing process is reported by name
    rather than as "late"), discards its staged files unless committed."""
    _distributed.publish(f"{op}/status", status, region=region)
    wait = 2 * _distributed.stall_timeout(region=region)
    outcome = _distributed.broadcast_str(f"{op}/outcome", None, region=region, timeout_s=wait)
    if STRUCTURE in outcome and structure is not None:
        mine = structure()
        _distributed.publish(f"{op}/structure", json.dumps(mine), region=region)  # for 0
        outcome += _first_difference(op, mine, region)
    if outcome != "committed":
        outcome = _discard(abort, outcome)  # e.g. staging of another step than the primary's
    return outcome


STRUCTURE = "tree of another structure"  # in the outcome when the digests differ


def _first_difference(op: str, mine: list[str], region, p: int = 0, timeout_s=None) -> str:
    """``; here ...``: the first leaf where this process's tree differs from process
    ``p``'s (the primary's, published with the outcome), or nothing when it cannot be
    read."""
    try:
        got = _distributed.get_from(f"{op}/structure", p, region=region, timeout_s=timeout_s)
        theirs = json.loads(got)
    except (CoordinationError, ValueError):
        return ""
    return _difference(mine, theirs, p)


def _their_difference(
    op: str, outcome: str, mine: list[str], region: _distributed.Region | None
) -> str:
    """The primary's side of :func:`_first_difference`: the process the outcome names
    publishes its leaves once it read the outcome (waited for a few seconds at most:
    nothing when it is gone)."""
    found = re.search(r"process ([0-9]+) saved a " + STRUCTURE, outcome)
    if found is None:
        return ""
    return _first_difference(op, mine, region, int(found.group(1)), timeout_s=10.0)


def _difference(mine: list[str], theirs: list[str], p: int) -> str:
    for a, b in zip(mine, theirs, strict=False):
        if a != b:
            return f"; the first leaf that differs: {a!r} here, {b!r} on process {p}"
    if len(mine) != len(theirs):
        extra = mine[len(theirs)] if len(mine) > len(theirs) else theirs[len(mine)]
        return (
            f"; {len(mine)} leaves here, {len(theirs)} on process {p} (the first one only "
            f"{'here' if len(mine) > len(theirs) else f'on process {p}'}: {extra!r})"
        )
    return "; the leaves' paths, kinds, dtypes, shapes and small values agree: a str leaf differs"


def _discard(abort: Callable[[], None], outcome: str) -> str:
    """Removes this process's staged files after a failed outcome; a removal that fails
    too is added to the outcome (reported with it), never passed over in silence."""
    try:
        abort()
    except Exception as e:  # noqa: BLE001
        me = _distributed.process_index()
        return f"{outcome} (and removing process {me}'s staged files failed: {e})"
    return outcome


CANCELLED = "cancelled, not committed; "  # the outcome when only cancellations failed


def _failed_outcome(statuses: list[dict[str, Any]]) -> str:
    """The outcome's head when some process failed: ``cancelled`` when every failure is
    a cancellation asked for (``SaveCancelledError``: every process then raises one, an
    agreed abort), else ``not committed``."""
    errors = [s["error"] for s in statuses if s["error"]]
    if all(e.startswith(f"{SaveCancelledError.__name__}:") for e in errors):
        return CANCELLED
    return "not committed; "


def _disagreement(statuses: list[dict[str, Any]]) -> str | None:
    first = statuses[0]
    for p, s in enumerate(statuses[1:], start=1):
        if s["step"] != first["step"]:
            return (
                f"disagree: process 0 saved step {first['step']} but process {p} saved step "
                f"{s['step']}; every process must save the same step"
            )
        if s["agreed"] != first["agreed"]:
            mine, theirs = first["agreed"], s["agreed"]
            names = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
            each = "; ".join(
                f"{k}: {mine.get(k)!r} on process 0, {theirs.get(k)!r} on process {p}"
                for k in names
            )
            return f"disagree: the processes saved with different options ({each}); " + (
                "every process must pass the same"
            )
        if s["digest"] != first["digest"]:
            return (
                f"disagree: process {p} saved a {STRUCTURE} than process 0 "
                f"(structure digests {s['digest'][:12]} and {first['digest'][:12]}) at step "
                f"{first['step']}; every process must save the same tree"
            )
    return None
