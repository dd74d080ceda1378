"""Removing steps and leftovers: retention's and ``delete``'s removal of a committed
step, housekeeping's removal of what dead saves left (a writer's open, ``gc``, after a
commit), a failed save's staging, and a replaced step's item directories. What proves
a place ours, and the removal of a place proven ours, are ``_core.ownership``'s; a save
that replaces nothing reads none of this module.

Threading: stateless; any function may be called from any thread. Callers serialise
removals of one place (the manager's writer lock, the tier's primary process).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable

import tensorstore as ts

from .._base import env as _env
from .._errors import CheckpointError, ForeignEntryError
from .._format import describe as _describe
from .._format.layout import MANIFEST_FILE, PENDING_FILE
from .._storage import deleting as _deleting
from .._storage.location import Location
from . import handle as _handle
from . import ownership as _ownership

logger = logging.getLogger("flax_orbax_plugin")


class RemainsLeftError(CheckpointError):
    """A removal took a place out of every listing (renamed it to ``<step>.deleting-*``,
    or deleted its manifest) but could not remove its files: they stay at ``place``,
    proven ours, and the next writer's open or ``gc`` tries again."""

    def __init__(self, message: str, place: str):
        super().__init__(message)
        self.place = place


def remove_if_ours(loc: Location, *, what: str) -> bool:
    """Housekeeping: removes ``loc`` when it is proven ours, else logs that it is left
    alone. Returns whether it was removed. Environmental errors propagate."""
    try:
        found = _ownership.proof(loc)
    except ForeignEntryError as e:
        logger.warning("checkpoint: %s left alone: %s", what, e)
        return False
    if found is None:
        if not _ownership.exists(loc):
            return False
        if loc.is_local and _ownership.rmdir_if_empty(loc):
            return True  # an empty directory holds nothing to lose (a cut-short removal)
        logger.warning(
            "checkpoint: %s %s left alone: nothing in it proves this library wrote it (%s)",
            what,
            loc,
            _describe.contents(loc),
        )
        return False
    logger.info("checkpoint: removing %s %s", what, loc)
    _ownership.remove_proven(loc)
    return True


def remove_leftover(loc: Location, *, what: str) -> tuple[bool, str | None]:
    """:func:`remove_if_ours` for housekeeping that must go on (a writer's open, ``gc``,
    after a commit): a leftover that cannot be removed (a folder made read-only, EIO) is
    passed over with a WARNING naming it and the error. Returns whether it was removed,
    and that error (None when there was none)."""
    try:
        return remove_if_ours(loc, what=what), None
    except (OSError, CheckpointError) as e:
        why = f"{type(e).__name__}: {e}"
        logger.warning("checkpoint: cannot remove %s %s, passed over: %s", what, loc, why)
        return False, why


def remove_staging(loc: Location, nonce: str, *, what: str = "staging") -> bool:
    """Removes the staging place of a save of this process (``nonce`` is that save's:
    drawn from this run's session nonce, a name nobody else creates). Proven by our
    marker, or on local disk by the name itself: only the primary claims, and the
    others' staging of a step the primary did not save carries no marker."""
    _env.fail_point("remove_staging")  # tests: a removal that fails (FOP_FAIL_AT)
    if loc.is_local and _ownership.rmdir_if_empty(loc):
        return True  # nothing was written (a full disk, a file size limit): no marker needed
    if _ownership.proof(loc) is None and loc.is_local and loc.name.endswith(f".partial-{nonce}"):
        if _ownership.exists(loc):
            logger.info("checkpoint: removing this save's %s %s", what, loc)
            _ownership.remove_proven(loc)
            return True
        return False
    return remove_if_ours(loc, what=what)


def remove_step(directory: Location, step: int, *, pace: Callable[[], int] | None = None) -> None:
    """Deletes a committed step of ``directory`` so that it disappears from listings
    at once: on local disk a rename to ``<step>.deleting-<nonce>``; on object stores
    the manifest goes first (after the pending marker), then its objects, many at once:
    ``pace()`` (asked before each request; default :data:`REMOVAL_CONCURRENCY`) is how
    many deletes may be in flight now (retention asks for fewer while a save runs).

    A failure once the step has left the listings (renamed, or its manifest deleted) is
    a :class:`RemainsLeftError` naming the place its files stay in and why."""
    step_loc = directory.child(str(step))
    _ownership.require_ours(step_loc, action="delete step", step=step)
    _env.fail_point("remove_step")  # tests: a removal that fails (FOP_FAIL_AT)
    keep = _ownership.strangers(step_loc)  # someone else's files stay where they are
    if directory.supports_rename and not keep:
        doomed = directory.child(f"{step}.deleting-{secrets.token_hex(6)}")
        step_loc.rename(doomed)  # atomic: the step disappears from listings at once
        _env.kill_point("mid_retention")
        _env.pause_point("mid_retention")  # tests: a slow removal (FOP_PAUSE_AT)
        _remove_remains(step, doomed, keep=keep, how=f"renamed to {doomed.name}")
        return
    step_loc.write_bytes(
        PENDING_FILE, _handle.marker_bytes(secrets.token_hex(6), keep), durable=False
    )
    step_loc.delete(MANIFEST_FILE)  # uncommit first, then delete the data
    _env.kill_point("mid_retention")
    _env.pause_point("mid_retention")
    _remove_remains(step, step_loc, pace=pace, keep=keep, how="its manifest deleted")


def _remove_remains(
    step: int, loc: Location, *, how: str, pace: Callable[[], int] | None = None, keep: list[str]
) -> None:
    """:func:`remove_step` once the step left the listings: its files go, or a
    RemainsLeftError says where they stay and why (never "already gone")."""
    try:
        _env.fail_point("remove_remains")  # tests: a removal that fails midway (FOP_FAIL_AT)
        _ownership.remove_proven(loc, pace=pace, keep=keep)
    except (OSError, CheckpointError) as e:
        raise RemainsLeftError(
            f"step {step} left the listing ({how}) but removing its files failed: "
            f"{type(e).__name__}: {e}; they stay in {loc} (proven ours) until the next "
            f"writer's open or gc() removes them",
            str(loc),
        ) from e


def remove_children(loc: Location, names: list[str], *, action: str) -> None:
    """Removes the named children of ``loc`` (item directories of an old version of a
    step, after a replacing commit on an object store) once ``loc`` is proven ours."""
    _ownership.require_ours(loc, action=action)
    for name in names:
        remove_tree(loc.child(name))


def remove_tree(loc: Location) -> None:
    """Removes a child of a place already proven ours (no proof of its own needed; the
    item directories of a replaced step: ``removing.remove_children``)."""
    if loc.is_local:
        path = loc.path.rstrip("/")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return
    kv = ts.KvStore.open(loc.spec, context=_deleting.removal_context(loc.spec)).result()
    kv.delete_range(ts.KvStore.KeyRange()).result()
