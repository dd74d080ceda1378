"""The one owner of removal: every delete, clear, swap and overwrite of a checkpoint,
a step or a staging place goes through this module, on every store.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.ownership``.

Threading: stateless; any function may be called from any thread. Callers serialise
removals of one place (the manager's writer lock, the tier's primary process).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import stat
from collections.abc import Callable

import tensorstore as ts

from .._base import distributed as _distributed
from .._base import env as _env
from .._errors import CheckpointError, ForeignEntryError
from .._format.layout import COMMIT_FILE, MANIFEST_FILE, PENDING_FILE, CommitMarker, StepManifest
from .._storage import json_docs as _docs
from .._storage.deleting import removal_context
from .._storage.local_files import entry_kind
from .._storage.location import Location
from . import removing as _removing

logger = logging.getLogger("flax_orbax_plugin")

_LIBRARY = "flax_orbax_plugin"


def _pending_bytes(nonce: str, keep: list[str] | tuple[str, ...] = ()) -> bytes:
    """The pending marker: ours, with the writer (host name and process id) that lets a
    later save or ``gc`` tell a save that died from one still running; ``keep``: what
    a removal leaves (entries this library did not write)."""
    doc = {"library": _LIBRARY, "kind": "pending", "nonce": nonce}
    doc.update(host=socket.gethostname(), pid=os.getpid())
    if keep:
        doc["keep"] = list(keep)
    return json.dumps(doc).encode()


def _marker_keeps(raw: bytes | None) -> list[str]:
    """What a removal recorded in the pending marker ``raw`` that it leaves."""
    keep = json.loads(raw).get("keep") if _is_pending_marker(raw) else None
    return keep if isinstance(keep, list) and all(isinstance(k, str) for k in keep) else []


def claim(loc: Location, nonce: str) -> None:
    """Marks ``loc`` as a place this library is writing (staging) or removing.

    Written by one process per place (the primary, or each process in its own copy).
    Not fsynced on its own: a later ``sync`` of the staging place makes it durable.
    """
    loc.write_bytes(PENDING_FILE, _pending_bytes(nonce), durable=False)


def unclaim(loc: Location) -> None:
    """Deletes the pending marker once the commit record (manifest or commit marker)
    that proves ``loc`` ours is written."""
    loc.delete(PENDING_FILE)


def _is_pending_marker(raw: bytes | None) -> bool:
    if raw is None:
        return False
    try:
        doc = _docs.parse(raw, PENDING_FILE, _docs.PENDING_MARKER)
    except CheckpointError:
        return False
    return isinstance(doc, dict) and doc.get("library") == _LIBRARY and doc.get("kind") == "pending"


def _pending_writer(raw: bytes | None) -> tuple[str, int] | None:
    """The writer a pending marker names (host, pid), or None where it names none that
    can be trusted (an older marker, a damaged or foreign one)."""
    if not _is_pending_marker(raw):
        return None
    doc = json.loads(raw)
    host, pid = doc.get("host"), doc.get("pid")
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
        return None
    return host, pid


def writer_gone(loc: Location) -> bool:
    """True when ``loc`` carries our pending marker and the process that wrote it ran on
    this host and is no longer alive: a save (or removal) that was killed or interrupted
    before it could clean up, and that nobody is still writing. False whenever that is
    not certain (another host, this very process, a marker naming no writer)."""
    try:
        writer = _pending_writer(loc.read_bytes(PENDING_FILE))
    except CheckpointError:
        return False  # a link or a FIFO where our marker would be: not ours
    if writer is None or writer[0] != socket.gethostname() or writer[1] == os.getpid():
        return False
    try:
        os.kill(writer[1], 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def proof(loc: Location, *, step: int | None = None) -> str | None:
    """What proves ``loc`` ours (``"step manifest"``, ``"commit marker"``, ``"pending
    marker"``), or None. With ``step``, a manifest must name that step. Raises
    ForeignEntryError when ``loc`` (on local disk) is not a real directory."""
    if loc.is_local:
        path = loc.path.rstrip("/")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            raise ForeignEntryError(
                f"{path}: expected a directory this library created, found {entry_kind(st.st_mode)}"
            )
    try:
        if _is_pending_marker(loc.read_bytes(PENDING_FILE)):
            return "pending marker"
        raw = loc.read_bytes(MANIFEST_FILE)
        if raw is not None:
            manifest = StepManifest.from_bytes(raw, f"{loc}/{MANIFEST_FILE}")
            if step is None or manifest.step == step:
                return "step manifest"
            return None
        raw = loc.read_bytes(COMMIT_FILE)
        if raw is not None:
            CommitMarker.from_bytes(raw, f"{loc}/{COMMIT_FILE}")
            return "commit marker"
    except ForeignEntryError:
        return None  # a link or a FIFO where our file would be: not ours
    except CheckpointError:
        return None  # a damaged record proves nothing
    return None


def is_empty(loc: Location) -> bool:
    """True when nothing at all is stored at ``loc`` (an empty local directory too)."""
    if loc.is_local:
        try:
            with os.scandir(loc.path.rstrip("/")) as it:
                return next(it, None) is None
        except (FileNotFoundError, NotADirectoryError):
            return True
    return not loc.is_dir()


def describe(loc: Location, limit: int = 5) -> str:
    """A short list of what ``loc`` holds, for error messages."""
    names = loc.list_children()
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f"it holds {shown}" if names else "it is empty"


def require_ours(loc: Location, *, action: str, step: int | None = None) -> str:
    """The proof that ``loc`` is ours; ForeignEntryError naming it otherwise."""
    found = proof(loc, step=step)
    if found is None:
        raise ForeignEntryError(
            f"refusing to {action} {loc}: expected a checkpoint or step this library "
            f"created (our manifest, commit marker or pending marker), found none "
            f"({describe(loc)}); nothing was changed"
        )
    return found


def remove(loc: Location, *, action: str = "remove", step: int | None = None) -> bool:
    """Removes ``loc`` whole once it is proven ours; False (and nothing changed) when
    nothing is there; ForeignEntryError when it is not ours.

    Crash-safe: the pending marker is written first and deleted last, so a removal
    cut short leaves remains that are still proven ours (and removed next time).
    """
    if is_empty(loc) and not _exists(loc):
        return False
    require_ours(loc, action=action, step=step)
    _remove_proven(loc)
    return True


def remove_if_ours(loc: Location, *, what: str) -> bool:
    """Housekeeping: removes ``loc`` when it is proven ours, else logs that it is left
    alone. Returns whether it was removed. Environmental errors propagate."""
    try:
        found = proof(loc)
    except ForeignEntryError as e:
        logger.warning("checkpoint: %s left alone: %s", what, e)
        return False
    if found is None:
        if not _exists(loc):
            return False
        if loc.is_local and _rmdir_if_empty(loc):
            return True  # an empty directory holds nothing to lose (a cut-short removal)
        logger.warning(
            "checkpoint: %s %s left alone: nothing in it proves this library wrote it (%s)",
            what,
            loc,
            describe(loc),
        )
        return False
    logger.info("checkpoint: removing %s %s", what, loc)
    _remove_proven(loc)
    return True


def remove_staging(loc: Location, nonce: str, *, what: str = "staging") -> bool:
    """Removes the staging place of a save of this process (``nonce`` is that save's:
    drawn from this run's session nonce, a name nobody else creates). Proven by our
    marker, or on local disk by the name itself: only the primary claims, and the
    others' staging of a step the primary did not save carries no marker."""
    _env.fail_point("remove_staging")  # tests: a removal that fails (FOP_FAIL_AT)
    if proof(loc) is None and loc.is_local and loc.name.endswith(f".partial-{nonce}"):
        if _exists(loc):
            logger.info("checkpoint: removing this save's %s %s", what, loc)
            _remove_proven(loc)
            return True
        return False
    return remove_if_ours(loc, what=what)


def remove_step(directory: Location, step: int, *, pace: Callable[[], int] | None = None) -> None:
    """Deletes a committed step of ``directory`` so that it disappears from listings
    at once: on local disk a rename to ``<step>.deleting-<nonce>``; on object stores
    the manifest goes first (after the pending marker), then its objects, many at once:
    ``pace()`` (asked before each request; default :data:`REMOVAL_CONCURRENCY`) is how
    many deletes may be in flight now (retention asks for fewer while a save runs)."""
    step_loc = directory.child(str(step))
    require_ours(step_loc, action="delete step", step=step)
    _env.fail_point("remove_step")  # tests: a removal that fails (FOP_FAIL_AT)
    keep = _removing.strangers(step_loc)  # someone else's files stay where they are
    if directory.supports_rename and not keep:
        doomed = directory.child(f"{step}.deleting-{secrets.token_hex(6)}")
        step_loc.rename(doomed)  # atomic: the step disappears from listings at once
        _env.kill_point("mid_retention")
        _env.pause_point("mid_retention")  # tests: a slow removal (FOP_PAUSE_AT)
        _remove_proven(doomed, keep=keep)
        return
    step_loc.write_bytes(PENDING_FILE, _pending_bytes(secrets.token_hex(6), keep), durable=False)
    step_loc.delete(MANIFEST_FILE)  # uncommit first, then delete the data
    _env.kill_point("mid_retention")
    _env.pause_point("mid_retention")
    _remove_proven(step_loc, pace=pace, keep=keep)


def check_slot(loc: Location, *, what: str, replace: bool) -> str | None:
    """Before writing a checkpoint or step at ``loc``: refuses a place held by something
    foreign (ForeignEntryError naming it), and a committed one of ours unless
    ``replace``. An empty place, or remains of a dead save of ours, are fine.
    Returns the proof found (None for an empty place)."""
    if is_empty(loc):
        return None
    found = proof(loc)
    if found is None:
        raise ForeignEntryError(
            f"cannot write {what} at {loc}: something this library did not create is "
            f"there ({describe(loc)}); it is left alone. Move it away or choose another path"
        )
    if found != "pending marker" and not replace:
        raise CheckpointError(
            f"{loc} already holds a committed checkpoint ({found}); pass force=True "
            f"(overwrite=True for a manager step) to replace it"
        )
    if strangers := _removing.strangers(loc):
        raise ForeignEntryError(
            f"cannot replace {what} at {loc}: it holds entries this library did not write "
            f"({', '.join(strangers[:5])}{', ...' if len(strangers) > 5 else ''}); they "
            f"are left alone. Move them away, then save again"
        )
    return found


def remove_children(loc: Location, names: list[str], *, action: str) -> None:
    """Removes the named children of ``loc`` (item directories of an old version of a
    step, after a replacing commit on an object store) once ``loc`` is proven ours."""
    require_ours(loc, action=action)
    for name in names:
        _remove_tree(loc.child(name))


def _rmdir_if_empty(loc: Location) -> bool:
    try:
        os.rmdir(loc.path.rstrip("/"))  # refused unless empty: nothing can be lost
    except OSError:
        return False
    return True


def _exists(loc: Location) -> bool:
    if loc.is_local:
        return os.path.lexists(loc.path.rstrip("/"))
    return loc.is_dir()


def _remove_proven(
    loc: Location, *, pace: Callable[[], int] | None = None, keep: list[str] | None = None
) -> None:
    """Removes what this library wrote at ``loc`` (``_core.removing``), the pending
    marker first (naming what is left, so that a removal cut short leaves it too) and
    last. ``keep``: what was found there already (``remove_step``: not looked for again)."""
    raw = loc.read_bytes(PENDING_FILE)
    found = _removing.strangers(loc) if keep is None else keep
    keep = sorted(set(_marker_keeps(raw)) | set(found))
    if raw is None or keep != _marker_keeps(raw):
        loc.write_bytes(PENDING_FILE, _pending_bytes(secrets.token_hex(6), keep))  # durable
    _removing.remove_all_but(loc, keep, pace=pace)


def _remove_tree(loc: Location) -> None:
    """Removes a child of a place already proven ours (no proof of its own needed)."""
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
    kv = ts.KvStore.open(loc.spec, context=removal_context(loc.spec)).result()
    kv.delete_range(ts.KvStore.KeyRange()).result()


def prepare_slot(loc: Location, *, what: str, replace: bool, clear: bool = True) -> bool:
    """:func:`check_slot` for a save about to write at ``loc``, agreed by every process;
    with ``clear`` a dead save's remains (or, with ``replace``, a committed checkpoint)
    are removed too. Returns whether ``loc`` held something of ours (with ``clear=False``:
    what the caller must clear before anyone writes). Collective on several processes.

    On an object store every process writes into ``loc`` itself (no staging name), so a
    fast process's first object could land before a slower one looks, and two processes
    would then decide differently (one clears and waits for the others, which write: a
    hang, or the others' data deleted). So the primary alone looks, before anyone writes,
    and every process waits for its verdict (one key-value round). Local stores stage
    under names of their own and every process may look there.
    """

    def look() -> bool:
        held = check_slot(loc, what=what, replace=replace) is not None
        if held and clear:
            remove(loc, action="clear the remains of a dead save at")
        return held

    if loc.supports_rename or _distributed.process_count() == 1:
        return look()
    verdict = {"held": False, "error": None, "kind": None}
    op = _distributed.next_operation_id("slot")
    own_error = None
    if _distributed.is_primary():
        try:
            verdict["held"] = look()
        except Exception as e:  # noqa: BLE001  (every process learns of it, then raises)
            own_error = e
            verdict.update(error=str(e), kind=type(e).__name__)
    verdict = json.loads(_distributed.broadcast_str(op, json.dumps(verdict)))
    if own_error is not None:
        raise own_error
    if verdict["error"] is not None:
        kind = ForeignEntryError if verdict["kind"] == "ForeignEntryError" else CheckpointError
        raise kind(f"{verdict['error']} (checked by process 0)")
    return bool(verdict["held"])


def missing_directories(path: str) -> list[str]:
    """The directories that creating local ``path`` (``os.makedirs``) would create, the
    deepest first: what a failed import or export created, and so may remove."""
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_created(directories: list[str], files: tuple[str, ...] = ()) -> None:
    """After a failed import or export: removes ``files`` (names inside the deepest of
    ``directories`` that this call created: regular files, never through a link), then
    each of ``directories`` that is empty, deepest first (``rmdir``: a directory that
    holds anything else, someone else's included, stays)."""
    for name in files if directories else ():
        path = os.path.join(directories[0], name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
    for path in directories:
        try:
            os.rmdir(path)
        except OSError:
            return  # not empty (or gone): it and its parents stay
