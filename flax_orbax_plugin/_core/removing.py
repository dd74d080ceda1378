"""What a removal of a place of ours takes, and what it leaves: the names this library
did not write.

A step or a checkpoint is ours once proven (``ownership.proof``), but a user may put a
file into it afterwards (notes, an export, a plot). Every removal (retention,
``CheckpointManager.delete``, ``gc``, the remains of a save cut short) removes only the
names this library writes and leaves the others where they are, with a warning;
replacing a checkpoint that holds such names is refused (``ownership.check_slot``).

The names this library writes, by place:

- **a step** (proven by its manifest): the manifest, the pending marker, a host's
  marker (a directory per host) and the item
  directories the manifest names. Inside an item of kind ``pytree``, a checkpoint's
  names (below); inside a ``json``, ``step`` or ``data_iterator`` item, the JSON files
  the manifest lists for it. An item of any other kind belongs to its checkpointable,
  whose files this library cannot tell apart: all of it is the item's.
- **a checkpoint** (``fop.save``'s directory, proven by its commit marker; a pytree
  item): ``_METADATA.json``, ``_COMMITTED``, the pending marker, ``d/`` and ``b/``
  (version 1's zarr arrays, named by tensorstore below them) and ``data/`` holding
  ``<process>.json`` indexes and ``<process>-<n>.bin`` data files (version 2).
- **a place proven only by the pending marker** (staging, a save cut short): all ours;
  its name is fresh, nobody else writes there. A removal cut short records what it
  leaves in its pending marker, so the next attempt leaves it too.
- **anywhere** (local disk): a temporary file of the pending marker's write
  (``_PENDING.json.tmp-<hex>``, no larger than a marker), whatever it holds: a
  removal killed between creating it and renaming it, empty if before its write
  (``_core.pending.temporary_files``).

Threading: stateless; callers serialise removals of one place (``_core.ownership``).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
from collections.abc import Callable

import tensorstore as ts

from .._errors import CheckpointError
from .._format.layout import (
    COMMIT_FILE,
    HOST_FILE,
    MANIFEST_FILE,
    PENDING_FILE,
    StepManifest,
)
from .._storage import deleting as _deleting
from .._storage.location import Location
from . import formats as _formats
from . import pending as _pending

logger = logging.getLogger("flax_orbax_plugin")

_JSON_KINDS = ("json", "step", "data_iterator")

# parts (relative path split on '/'), whether a directory -> the library writes it
Rule = Callable[[list[str], bool], bool]


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


def rule_for(loc: Location) -> Rule | None:
    """The names the library writes at ``loc``, from its commit record (None: no
    readable record, everything there is the library's: staging, a save cut short)."""
    try:
        raw = loc.read_bytes(MANIFEST_FILE)
        if raw is not None:
            return _step_rule(StepManifest.from_bytes(raw, f"{loc}/{MANIFEST_FILE}"))
        if loc.read_bytes(COMMIT_FILE) is not None:
            return _formats.checkpoint_names
    except CheckpointError:
        return None  # damaged: ``proof`` does not prove such a place ours either
    return None


def strangers(loc: Location) -> list[str]:
    """The entries under ``loc`` (relative paths, sorted) that the library did not write:
    a directory of someone else's is named once, not walked. Object stores name keys."""
    rule = rule_for(loc)
    if rule is None:
        return []
    if not loc.is_local:
        return sorted(k for k in loc.keys() if not rule(k.split("/"), False))
    ours = set(_pending.temporary_files(loc))  # our marker's write cut short, even empty
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


def enclosing(names: list[str]) -> set[str]:
    """Every directory (relative path) that holds one of ``names``: what a removal that
    leaves them must keep."""
    out = set()
    for name in names:
        parts = name.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return out


def remove_all_but(loc: Location, keep: list[str], *, pace: Callable[[], int] | None) -> None:
    """Removes everything at ``loc`` but ``keep`` (relative paths, with the directories
    holding them), the pending marker last; ``loc`` itself goes when nothing is kept.
    What is kept is named in a warning. Object stores: see ``_storage.deleting`` for
    ``pace``."""
    kept, holders = set(keep), enclosing(keep)
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


def remove_tree(loc: Location) -> None:
    """Removes a child of a place already proven ours (no proof of its own needed; the
    item directories of a replaced step: ``ownership.remove_children``)."""
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
    """``shutil.rmtree`` (fd-based: links inside are unlinked, not followed), its error
    naming the full path of what it could not remove (not the bare name it had)."""

    def fail(_func, where, exc_info) -> None:
        e = exc_info[1] if isinstance(exc_info, tuple) else exc_info
        if isinstance(e, OSError) and e.errno is not None:
            raise OSError(e.errno, e.strerror, where) from e
        raise e

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fail)
    else:
        shutil.rmtree(path, onerror=fail)
