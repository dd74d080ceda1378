"""The one owner of removal, on every store: what proves a place ours, the claims, the
checks before a save writes, and the removal of what is proven ours.

Threading: stateless; any function may be called from any thread. Callers serialise
removals of one place (the manager's writer lock, the tier's primary process).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.ownership``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import stat
import sys
from collections.abc import Callable

import tensorstore as ts

from .._base import distributed as _distributed
from .._base import env as _env
from .._errors import CheckpointError, ForeignEntryError
from .._format import steps as _steps
from .._format.layout import (
    COMMIT_FILE,
    HOST_FILE,
    MANIFEST_FILE,
    PENDING_FILE,
    CommitMarker,
    StepManifest,
    manifest_from_bytes,
)
from .._storage import deleting as _deleting
from .._storage.location import Location
from .._storage.untrusted import entry_kind
from . import formats as _formats
from . import handle as _handle
from . import writer_liveness as _liveness

logger = logging.getLogger("flax_orbax_plugin")


_pending_bytes = _handle.marker_bytes  # the marker's helpers, under the names callers know


def claim(loc: Location, nonce: str, *, fresh: bool = False) -> None:
    """Marks ``loc`` as a place this library writes or removes (durable at a ``sync``)."""
    if not loc.supports_rename:
        _liveness.claim_in_place(loc, nonce, fresh=fresh)
        return
    try:
        loc.write_bytes(PENDING_FILE, _pending_bytes(nonce), durable=False)
    except BaseException:
        if loc.is_local:
            rmdir_if_empty(loc)  # a fresh name nobody else writes: holds nothing
        raise


def unclaim(loc: Location) -> None:
    """Deletes the pending marker once the commit record proving ``loc`` ours is written."""
    _env.fail_point("unclaim")  # tests: a store refusing the removal (FOP_FAIL_AT)
    loc.delete(PENDING_FILE)


def proof(loc: Location, *, step: int | None = None) -> str | None:
    """What proves ``loc`` ours, or None; ForeignEntryError for a local non-directory."""
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
        if _handle.is_marker(loc.read_bytes(PENDING_FILE)):
            return "pending marker"
        raw = loc.read_bytes(MANIFEST_FILE)
        if raw is not None:
            manifest = manifest_from_bytes(raw, f"{loc}/{MANIFEST_FILE}")
            if step is None or manifest.step == step:
                return "step manifest"
            return None
        raw = loc.read_bytes(COMMIT_FILE)
        if raw is not None:
            CommitMarker.from_bytes(raw, f"{loc}/{COMMIT_FILE}")
            return "commit marker"
        if _handle.temporary_markers(loc):  # the marker's write cut short: still ours
            return "pending marker"
        # a staging name of ours holding only our marker's temporary files, empty too
        if _steps.SAVE_STAGING_RE.match(loc.name) and _handle.only_temporary_files(loc):
            return "pending marker"
    except CheckpointError:  # a damaged record, a link or a FIFO where ours would be
        return None
    return None


def is_empty(loc: Location) -> bool:
    """True when nothing at all is stored at ``loc`` (an empty local directory too)."""
    if loc.is_local:
        try:
            with os.scandir(loc.path.rstrip("/")) as it:
                return next(it, None) is None
        except FileNotFoundError:
            return True
        except NotADirectoryError:  # a file there is something; one on the way is not
            return not os.path.lexists(loc.path.rstrip("/"))
    return not loc.is_dir()


def require_ours(loc: Location, *, action: str, step: int | None = None) -> str:
    """The proof that ``loc`` is ours; ForeignEntryError naming it otherwise."""
    found = proof(loc, step=step)
    if found is None:
        raise ForeignEntryError(
            f"refusing to {action} {loc}: expected a checkpoint or step this library created "
            f"(a manifest or marker of ours), found none ({_steps.contents(loc)}); nothing changed"
        )
    return found


def remove(loc: Location, *, action: str = "remove", step: int | None = None) -> bool:
    """Removes ``loc`` whole once proven ours (ForeignEntryError if not); False if empty."""
    if is_empty(loc) and not exists(loc):
        return False
    require_ours(loc, action=action, step=step)
    remove_proven(loc)
    return True


def check_slot(loc: Location, *, what: str, replace: bool, take_empty: bool = True) -> str | None:
    """Before writing at ``loc``: refuses what is foreign, or committed unless ``replace``."""
    if is_empty(loc):
        if not take_empty and loc.is_local and exists(loc):
            raise ForeignEntryError(
                f"cannot write {what} at {loc}: an empty folder this library did not create "
                f"is there (never replaced: it is left alone); remove it, then save again"
            )
        return None
    try:
        found = proof(loc)
    except ForeignEntryError as e:  # a file, a link, a FIFO at the name
        raise ForeignEntryError(
            f"cannot write {what} at {loc}: {e}; it is left alone and nothing was "
            f"written. Move it away or choose another path"
        ) from None
    if found is None:
        raise ForeignEntryError(
            f"cannot write {what} at {loc}: something this library did not create is there "
            f"({_steps.contents(loc)}); it is left alone. Move it away or choose another path"
        )
    if found == "pending marker":
        _liveness.refuse_if_held(loc, replace=replace)
    if found != "pending marker" and not replace:
        raise CheckpointError(
            f"{loc} already holds a committed checkpoint ({found}); pass force=True "
            f"(overwrite=True for a manager step) to replace it"
        )
    if others := strangers(loc):
        raise ForeignEntryError(
            f"cannot replace {what} at {loc}: it holds entries this library did not write "
            f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); they "
            f"are left alone. Move them away, then save again"
        )
    return found


def rmdir_if_empty(loc: Location) -> bool:
    try:
        os.rmdir(loc.path.rstrip("/"))  # refused unless empty: nothing can be lost
    except OSError:
        return False
    return True


def exists(loc: Location) -> bool:
    if loc.is_local:
        return os.path.lexists(loc.path.rstrip("/"))
    return loc.is_dir()


def remove_proven(
    loc: Location, *, pace: Callable[[], int] | None = None, keep: list[str] | None = None
) -> None:
    """Removes what this library wrote at ``loc``, under a marker naming what is kept."""
    raw = loc.read_bytes(PENDING_FILE)
    if raw is None and keep is None:
        raw = _pending_bytes(secrets.token_hex(6))
        loc.write_bytes(PENDING_FILE, raw)  # durable: nothing is removed before it
    found = strangers(loc) if keep is None else keep
    keep = sorted(set(_handle.keeps(raw)) | set(found))
    if raw is None or keep != _handle.keeps(raw):
        loc.write_bytes(PENDING_FILE, _pending_bytes(secrets.token_hex(6), keep))  # durable
    remove_all_but(loc, keep, pace=pace)


def prepare_slot(
    loc: Location,
    *,
    what: str,
    replace: bool,
    clear: bool = True,
    take_empty: bool = True,
    region: _distributed.Region,
) -> bool:
    """:func:`check_slot`, collective (object stores: the primary looks); whether ours."""

    def look() -> bool:
        held = check_slot(loc, what=what, replace=replace, take_empty=take_empty) is not None
        if held and clear:
            remove(loc, action="clear the remains of a dead save at")
        return held

    if loc.supports_rename or _distributed.process_count() == 1:
        return look()
    verdict = {"held": False, "error": None, "kind": None}
    op = region.next_operation_id("slot")
    own_error = None
    if _distributed.is_primary():
        try:
            verdict["held"] = look()
        except Exception as e:  # noqa: BLE001  (every process learns of it, then raises)
            own_error = e
            verdict.update(error=str(e), kind=type(e).__name__)
    verdict = json.loads(region.broadcast_str(op, json.dumps(verdict)))
    if own_error is not None:
        raise own_error
    if verdict["error"] is not None:
        kind = ForeignEntryError if verdict["kind"] == "ForeignEntryError" else CheckpointError
        raise kind(f"{verdict['error']} (checked by process 0)")
    return bool(verdict["held"])


_JSON_KINDS = ("json", "step", "data_iterator")

Rule = Callable[[list[str], bool], bool]  # (path parts, is a directory) -> the library's


def _step_rule(manifest: StepManifest) -> Rule:
    kinds = {e.dir: e.kind for e in manifest.items.values()}

    def rule(parts: list[str], is_dir: bool) -> bool:
        head, rest = parts[0], parts[1:]
        if head not in kinds:
            return not rest and not is_dir and head in (MANIFEST_FILE, PENDING_FILE, HOST_FILE)
        kind = kinds[head]
        if not rest:
            return is_dir
        if kind == "pytree":
            return _formats.checkpoint_names(rest, is_dir)
        if kind in _JSON_KINDS:
            name = "/".join(parts)
            if is_dir:
                return any(f.startswith(name + "/") for f in manifest.files)
            return name in manifest.files or rest == [PENDING_FILE]
        return True  # a custom checkpointable's directory: all of it is the item's

    return rule


def strangers(loc: Location) -> list[str]:
    """The entries under ``loc`` its commit record does not name (a foreign directory once)."""
    rule: Rule
    try:
        raw = loc.read_bytes(MANIFEST_FILE)
        if raw is not None:
            rule = _step_rule(manifest_from_bytes(raw, f"{loc}/{MANIFEST_FILE}"))
        elif loc.read_bytes(COMMIT_FILE) is not None:
            rule = _formats.checkpoint_names
        else:
            return []
    except CheckpointError:
        return []  # damaged: ``proof`` does not prove such a place ours either
    if not loc.is_local:
        return sorted(k for k in loc.keys() if not rule(k.split("/"), False))
    ours = set(_handle.temporary_files(loc))  # our marker's write cut short, even empty
    out: list[str] = []
    stack = [""]
    root = loc.path.rstrip("/")
    while stack:
        rel = stack.pop()
        try:
            it = os.scandir(os.path.join(root, rel) if rel else root)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for entry in it:
                name = f"{rel}{entry.name}"
                is_dir = entry.is_dir(follow_symlinks=False)
                if name in ours:
                    continue
                if not rule(name.split("/"), is_dir):
                    out.append(name)
                elif is_dir:
                    stack.append(name + "/")
    return sorted(out)


def remove_all_but(loc: Location, keep: list[str], *, pace: Callable[[], int] | None) -> None:
    """Removes all at ``loc`` but ``keep`` (warned of), the pending marker last."""
    kept = set(keep)
    holders = {"/".join(k.split("/")[:i]) for k in keep for i in range(1, k.count("/") + 1)}
    if loc.is_local:
        _clear_local(loc.path.rstrip("/"), "", kept, holders)
        os.unlink(os.path.join(loc.path.rstrip("/"), PENDING_FILE))
        if not keep:
            os.rmdir(loc.path.rstrip("/"))
    else:
        kv = ts.KvStore.open(loc.spec, context=_deleting.removal_context(loc.spec)).result()
        marker = PENDING_FILE.encode()
        keys = [k for k in kv.list().result() if k != marker and k.decode() not in kept]
        _deleting.delete_objects(loc, kv, keys, pace)
        if not keep:  # anything the listing missed (nothing is kept: no key is spared)
            kv.delete_range(ts.KvStore.KeyRange(exclusive_max=PENDING_FILE)).result()
            kv.delete_range(ts.KvStore.KeyRange(inclusive_min=PENDING_FILE + "\0")).result()
        kv.delete_range(
            ts.KvStore.KeyRange(inclusive_min=PENDING_FILE, exclusive_max=PENDING_FILE + "\0")
        ).result()
    if keep:
        shown = ", ".join(keep[:10]) + (", ..." if len(keep) > 10 else "")
        logger.warning(
            "checkpoint: removed what this library wrote at %s, and left alone %d "
            "entr%s it did not write: %s (move them away; the folder stays for them)",
            loc,
            len(keep),
            "y" if len(keep) == 1 else "ies",
            shown,
        )


def _clear_local(root: str, rel: str, kept: set[str], holders: set[str]) -> None:
    with os.scandir(os.path.join(root, rel) if rel else root) as it:
        entries = list(it)
    for entry in entries:
        name = f"{rel}{entry.name}"
        if name == PENDING_FILE or name in kept:
            continue
        if not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.path)  # a link itself, never its target
        elif name in holders:
            _clear_local(root, name + "/", kept, holders)
        else:
            _rmtree(entry.path)


def _rmtree(path: str) -> None:
    """``shutil.rmtree`` (links unlinked, never followed), its error naming the full path."""

    def fail(_func, where, exc_info) -> None:
        e = exc_info[1] if isinstance(exc_info, tuple) else exc_info
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, where) from e
        raise e

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fail)
    else:
        shutil.rmtree(path, onerror=fail)


def missing_directories(path: str) -> list[str]:
    """The directories ``os.makedirs(path)`` would create, the deepest first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_created(directories: list[str], files: tuple[str, ...] = ()) -> None:
    """Removes ``files`` (in the deepest directory), then each empty directory."""
    for name in files if directories else ():
        path = os.path.join(directories[0], name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
    for path in directories:
        try:
            os.rmdir(path)
        except OSError:
            return  # not empty (or gone): it and its parents stay
