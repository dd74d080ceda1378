"""What other libraries' checkpoints look like: detection without their readers (in
``_interop``). Orbax is recognized by its file names, a Flax msgpack file by its first
byte; nothing is parsed. No link is followed below the path the user named; a FIFO or
device is refused without blocking. Any thread.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

from .._errors import CheckpointError, ForeignEntryError
from .._storage.location import Location
from .._storage.untrusted import entry_kind, open_regular
from .layout import MANIFEST_FILE, METADATA_FILE

STEP_METADATA = "_CHECKPOINT_METADATA"  # a step's (or a lone item's) handler record
ITEM_METADATA = "_METADATA"  # a pytree item's tree metadata
COMMIT_FILE = "commit_success.txt"  # orbax's commit mark where it cannot rename (GCS)
TMP_MARK = ".orbax-checkpoint-tmp"  # in the name of every unfinished orbax save
OWN_FILES = (METADATA_FILE, MANIFEST_FILE)  # this plugin's files: never Orbax
# '<step>', or '<prefix>_<step>' as orbax's step_prefix and flax.training.checkpoints name
# them (group 1: the prefix, group 2: the step); hidden entries never match.
STEP_RE = re.compile(r"^(?:([A-Za-z0-9][A-Za-z0-9._-]*)_)?([0-9]+)$", re.ASCII)


def is_step(loc: Location) -> bool:
    return loc.exists(STEP_METADATA) or loc.exists(ITEM_METADATA)


def is_orbax_checkpoint(path: Any) -> bool:
    """True when ``path`` is an Orbax item, step or manager directory (never one of ours):
    a manager directory's newest step-named entry that is a step of anyone's decides."""
    try:
        loc = Location.from_path(path)
    except (TypeError, ValueError):
        return False
    if any(loc.exists(name) for name in OWN_FILES):
        return False
    if is_step(loc):
        return True
    if loc.is_local and not loc.is_dir():
        return False
    for _, _, name in sorted(numbered_children(loc), reverse=True):  # newest first
        try:
            child = subdir(loc, name, "step")
            if child is None:
                continue  # a file: no step of anyone's
            if any(child.exists(n) for n in OWN_FILES):
                return False  # a directory of this library's steps
            if child.exists(STEP_METADATA) or legacy_step(child):
                return True
            if child.list_children():
                return False  # a folder of the user's (no record): not an Orbax run
        except (CheckpointError, OSError):  # a link, a special file, a folder shut by the
            continue  # environment: never followed here; its reader or listing names it
    # no step at all, but a save Orbax left unfinished: the reader says so
    return any(TMP_MARK in name for name in loc.list_children())


def numbered_children(loc: Location) -> list[tuple[int, str, str]]:
    """``(step, prefix, name)`` of the children named like steps (two may name one step)."""
    out = []
    for name in loc.list_children():
        m = STEP_RE.match(name)
        if m and TMP_MARK not in name:
            out.append((int(m.group(2)), m.group(1) or "", name))
    return out


OURS = "a step of this library, not of Orbax"
_MAX_LEGACY_PROBES = 16  # item folders looked into for a step without a record


def legacy_step(step_loc: Location) -> bool:
    """Whether ``step_loc`` is an older orbax's step (no record; an item holds ``_METADATA``)."""
    for name in [n for n in step_loc.list_children() if n[:1] not in "._"][:_MAX_LEGACY_PROBES]:
        try:
            child = subdir(step_loc, name, "item")
            if child is not None and child.exists(ITEM_METADATA):
                return True
        except CheckpointError:
            continue  # a link: never followed here; the reader names it
    return False


def not_finalized(step_loc: Location) -> str | None:
    """Why the directory ``step_loc`` (named like a step) is no finalized Orbax step, or None."""
    if any(step_loc.exists(n) for n in OWN_FILES):
        return OURS
    if not step_loc.exists(STEP_METADATA) and not legacy_step(step_loc):
        if not step_loc.list_children():
            return "an empty folder" if step_loc.is_local else "nothing stored under it"
        return f"no {STEP_METADATA} and no item holding {ITEM_METADATA} (not an Orbax step)"
    if step_loc.spec.get("driver") == "gcs" and not step_loc.exists(COMMIT_FILE):
        return f"no {COMMIT_FILE}: a save Orbax never finished on GCS"
    return None


def unfinished(loc: Location, record: Any) -> str | None:
    """Why the Orbax step or item at ``loc`` (``record``: its parsed record) is unfinished."""
    if TMP_MARK in loc.name:
        return f"its name holds {TMP_MARK!r}: Orbax renames a save into place once finished"
    if TMP_MARK in loc.parent.name:
        return f"it lies in {loc.parent}, a step Orbax never finished (named *{TMP_MARK}*)"
    if isinstance(record, dict) and record.get("commit_timestamp_nsecs", 0) is None:
        return (
            f"its {STEP_METADATA} has no commit time (commit_timestamp_nsecs: null), which "
            f"Orbax records as it finishes a save"
        )
    return None


def subdir(loc: Location, name: str, role: str) -> Location | None:
    """``loc/name`` if a directory; None if absent or a file; ForeignEntryError for a link."""
    if not loc.is_local:
        return loc.child(name)
    try:
        kind = entry_kind(os.lstat(os.path.join(loc.path, name)).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if kind == "a regular file":
        return None
    if kind != "a directory":
        raise ForeignEntryError(
            f"{loc.child(name)}: expected an Orbax {role} directory, found {kind} "
            f"(never followed or read)"
        )
    return loc.child(name)


_MSGPACK_FIXMAP = range(0x80, 0x90)
_MSGPACK_MAP16_32 = (0xDE, 0xDF)


def is_msgpack_checkpoint(path: Any) -> bool:
    """True for a file whose first byte opens a msgpack map (a Flax state dict)."""
    try:  # never a link; a FIFO or a device is refused without blocking
        fd, _ = open_regular(os.fspath(path), follow_links=False, what="msgpack checkpoint")
    except (OSError, TypeError, ValueError, CheckpointError):
        return False
    try:
        first = os.read(fd, 1)
    except OSError:
        return False
    finally:
        os.close(fd)
    return bool(first) and (first[0] in _MSGPACK_FIXMAP or first[0] in _MSGPACK_MAP16_32)


SAFETENSORS_SUFFIXES = (".safetensors", ".safetensors.index.json")


def safetensors_source(path: Any) -> str | list[str] | None:
    """What a safetensors reader takes for local ``path``; None when it holds none."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path if path.endswith(SAFETENSORS_SUFFIXES) else None
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(SAFETENSORS_SUFFIXES))
    except OSError:
        return None
    indexes = [n for n in names if n.endswith(SAFETENSORS_SUFFIXES[1])]
    if len(indexes) == 1:
        return os.path.join(path, indexes[0])
    files = [os.path.join(path, n) for n in names if n.endswith(SAFETENSORS_SUFFIXES[0])]
    return files or None


def refuse_foreign_run(loc: Location, *, writing: bool) -> None:
    """Raises CheckpointError, saying what to do instead, for a manager on another library's run."""
    held = foreign_run(loc)
    if held is None:
        return
    if writing:  # a resume there "started afresh" and wrote beside them
        raise CheckpointError(
            f"{loc} holds {held}: a manager writes steps of its own run, which would start "
            f"afresh there beside them. Convert them first (`flax-orbax import {loc} <new "
            f"directory>`, fop.import_orbax, fop.import_msgpack) and resume from that "
            f"directory, or write elsewhere"
        )
    read = (
        "fop.restore_msgpack" if held.startswith("Flax") else "fop.restore and fop.restore_params"
    )
    raise CheckpointError(
        f"{loc} holds {held}, not steps of this library: a CheckpointManager reads its own "
        f"steps only. {read} read it directly; `flax-orbax import {loc} <new directory>` "
        f"(fop.import_orbax, fop.import_msgpack) converts it into steps a manager reads"
    )


def foreign_format_hint(loc: Location) -> str:
    """``"; <what it is and what to do>"`` when ``loc`` is another library's, else ``""``."""
    with contextlib.suppress(CheckpointError):
        if loc.is_local and is_msgpack_checkpoint(loc.path.rstrip("/")):
            return (
                f"; {loc} is a Flax msgpack checkpoint: read it with fop.restore_msgpack, or "
                f"convert it with `flax-orbax import`"
            )
        if is_orbax_checkpoint(loc):
            return (
                f"; {loc} is an Orbax checkpoint: fop.restore and fop.restore_params read it "
                f"directly, `flax-orbax import` converts it into steps of this library"
            )
    return ""


_MSGPACK_STEP = re.compile(r"^[A-Za-z_]*checkpoint_[0-9]+$")


def foreign_run(loc: Location) -> str | None:
    """What ``loc`` holds, in words, if another library's run (Orbax, msgpack checkpoint_<n>)."""
    try:
        if not loc.is_dir():
            return None
        if is_orbax_checkpoint(loc):
            return "an Orbax run"
        if loc.is_local:
            for name in sorted(loc.list_children()):
                path = os.path.join(loc.path.rstrip("/"), name)
                if _MSGPACK_STEP.match(name) and is_msgpack_checkpoint(path):
                    return f"Flax msgpack checkpoints ({name})"
    except CheckpointError:
        return None
    return None
