"""Removing steps and leftovers (a committed step, a dead save's remains, a failed save's
staging), each proven ours by ``_core.ownership`` first.

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
from .._format import steps as _steps
from .._format.layout import MANIFEST_FILE, PENDING_FILE
from .._storage import deleting as _deleting
from .._storage.location import Location
from . import handle as _handle
from . import ownership as _ownership

logger = logging.getLogger("flax_orbax_plugin")


class RemainsLeftError(CheckpointError):
    """A place left every listing but its files stay at ``place``, proven ours."""

    def __init__(self, message: str, place: str):
        super().__init__(message)
        self.place = place


def remove_if_ours(loc: Location, *, what: str) -> bool:
    """Removes ``loc`` when proven ours, else logs that it is left alone; whether removed."""
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
            _steps.contents(loc),
        )
        return False
    logger.info("checkpoint: removing %s %s", what, loc)
    _ownership.remove_proven(loc)
    return True


def remove_leftover(loc: Location, *, what: str) -> tuple[bool, str | None]:
    """:func:`remove_if_ours`, a failure passed over with a WARNING: (removed, error)."""
    try:
        return remove_if_ours(loc, what=what), None
    except (OSError, CheckpointError) as e:
        why = f"{type(e).__name__}: {e}"
        logger.warning("checkpoint: cannot remove %s %s, passed over: %s", what, loc, why)
        return False, why


def remove_staging(loc: Location, nonce: str, *, what: str = "staging") -> bool:
    """Removes this save's staging, proven by our marker or (local) by its name."""
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
    """Deletes a committed step (out of the listings first); else RemainsLeftError."""
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
    """The step's files go, or a RemainsLeftError says where they stay."""
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
    """Removes the named children of ``loc`` (a replaced step's items) once proven ours."""
    _ownership.require_ours(loc, action=action)
    for name in names:
        remove_tree(loc.child(name))


def remove_tree(loc: Location) -> None:  # a child of a place proven ours
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
