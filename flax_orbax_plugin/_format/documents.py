"""Checked reads of a checkpoint's metadata document (``_METADATA.json``).

:func:`read_document` returns the validated :class:`CheckpointDocument` of a
committed checkpoint (a standalone one, or an item of a committed manager step),
checked against the checksum recorded at its commit; anything else is an error
saying what is there instead (a step, an unfinished save, another library's
checkpoint, a file, nothing). Reads two small JSON files; safe from any thread.
"""

from __future__ import annotations

from .._errors import CorruptCheckpointError
from .._storage import json_docs as _docs
from .._storage.location import Location
from . import layout as _layout
from . import steps as _steps
from .layout import COMMIT_FILE, METADATA_FILE, CheckpointDocument, CommitMarker
from .places import not_a_checkpoint


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
            raise not_a_checkpoint(location)
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
