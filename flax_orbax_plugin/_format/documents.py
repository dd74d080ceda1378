"""Checked reads of a checkpoint's metadata document (``_METADATA.json``).

:func:`read_document` returns the validated :class:`CheckpointDocument` of a
committed checkpoint (a standalone one, or an item of a committed manager step),
checked against the checksum recorded at its commit; anything else is an error
saying what is there instead (a step, an unfinished save, another library's
checkpoint, a file, nothing). Reads two small JSON files; safe from any thread.
"""

from __future__ import annotations

import fnmatch
import os

from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotCommittedError,
)
from .._storage import json_docs as _docs
from .._storage.location import Location
from . import layout as _layout
from . import steps as _steps
from .foreign import foreign_format_hint
from .layout import COMMIT_FILE, METADATA_FILE, CheckpointDocument, CommitMarker


def read_document(location: Location) -> CheckpointDocument:
    """The validated metadata of a committed checkpoint (a standalone one, or an item of
    a committed manager step), checked against the checksum recorded at its commit."""
    where = f"{location}/{METADATA_FILE}"
    raw = read_listed(location, METADATA_FILE)
    return CheckpointDocument.from_json(_layout.decode(raw, where, _docs.METADATA), where)


def read_listed(location: Location, name: str) -> bytes:
    """The bytes of the JSON file ``name`` of a committed checkpoint, checked against
    the sha256 its commit recorded (the commit marker's, or the step manifest's, file
    list); CorruptCheckpointError when it is unlisted, missing or changed."""
    where = f"{location}/{name}"
    raw_marker = location.read_bytes(COMMIT_FILE)
    if raw_marker is not None:
        marker = CommitMarker.from_bytes(raw_marker, f"{location}/{COMMIT_FILE}")
        expected = marker.files.get(name)
    else:
        manifest = _steps.manifest_for_item(location)
        if manifest is None:
            raise _not_a_checkpoint(location)
        expected = manifest.file_checksum(location.name, name)
    if expected is None:
        raise CorruptCheckpointError(
            f"{where}: the commit records no checksum for it (the item is not a "
            f"pytree, or the file list was damaged)"
        )
    raw = location.read_bytes(name)
    if raw is None:
        raise CorruptCheckpointError(f"{location} is committed but {name} is missing")
    found = _layout.sha256(raw)
    if found != expected:
        _layout.sha256_mismatch(where, expected, found)
    return raw


def _not_a_checkpoint(location: Location) -> CheckpointError:
    if location.exists(_layout.MANIFEST_FILE):
        return CheckpointError(
            f"{location} is a step of a checkpoint directory, not one pytree: restore one of "
            f"its items ({location}/params) or use CheckpointManager / restore_params"
        )
    run = _run_directory_message(location)
    if run is not None:
        return CheckpointNotFoundError(run)
    if location.is_dir() or _has_partial_sibling(location):
        return NotCommittedError(
            f"{location} is not a committed checkpoint: its save was interrupted or is "
            f"still running"
        )
    hint = foreign_format_hint(location)
    if hint:
        return CheckpointNotFoundError(f"no checkpoint of this library at {location}{hint}")
    if location.is_local and os.path.lexists(location.path.rstrip("/")):
        return CheckpointNotFoundError(f"{location} is a file, not a checkpoint directory")
    return CheckpointNotFoundError(f"no checkpoint at {location}: the path does not exist")


def _run_directory_message(location: Location) -> str | None:
    """What to call on a directory of manager steps (it holds committed steps, or
    our run records); None for anything else. Lists it once (an error path only)."""
    try:
        if location.is_local and not location.is_dir():
            return None
        listing = _steps.list_directory(location)
        records = any(location.exists(n) for n in _steps.RECORD_NAMES)
    except (CheckpointError, OSError):
        return None
    if not listing.committed and not records:
        return None
    latest = listing.latest
    if latest is None:
        steps = "no committed step yet"
        item = f"{location}/<step>/params"
    else:
        shown = ", ".join(map(str, listing.committed[-5:]))
        more = "..., " if len(listing.committed) > 5 else ""
        steps = f"steps {more}{shown}"
        item = f"{location}/{latest}/params"
    return (
        f"{location} is a run directory of CheckpointManager ({steps}), not one "
        f"checkpoint: restore a step with fop.CheckpointManager({str(location)!r}, "
        f"read_only=True).restore(like=state) (or CheckpointCallback(..., resume=True)), "
        f"its params alone with fop.restore_params({str(location)!r}, like), or name one "
        f"item of a step: {item!r}"
    )


def _has_partial_sibling(location: Location) -> bool:
    if not location.is_local:
        return False
    parent = os.path.dirname(location.path.rstrip("/"))
    try:
        names = os.listdir(parent)
    except OSError:
        return False
    return bool(fnmatch.filter(names, f"{location.name}.partial-*"))
