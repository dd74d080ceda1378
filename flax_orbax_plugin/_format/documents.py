"""Checked reads of a checkpoint's metadata document (``_METADATA.json``).

:func:`read_document` returns the validated :class:`CheckpointDocument` of a
committed checkpoint (a standalone one, or an item of a committed manager step),
checked against the checksum recorded at its commit; anything else is an error
saying what is there instead (a step, an unfinished save, another library's
checkpoint, a file, nothing). Reads two small JSON files; safe from any thread.
"""

from __future__ import annotations

import dataclasses

from .._errors import CorruptCheckpointError
from .._storage import json_docs as _docs
from .._storage.location import Location
from . import layout as _layout
from . import steps as _steps
from .layout import COMMIT_FILE, METADATA_FILE, CheckpointDocument, CommitMarker
from .places import not_a_checkpoint


def read_document(location: Location) -> CheckpointDocument:
    """The validated metadata of a committed checkpoint (a standalone one, or an item of
    a committed manager step), checked against the checksum recorded at its commit;
    the checksums its commit recorded ride along (``listed``), so that the other JSON
    files of one read are checked without reading the commit again."""
    where = f"{location}/{METADATA_FILE}"
    listed = listed_checksums(location)
    raw = read_listed(location, METADATA_FILE, listed=listed)
    doc = CheckpointDocument.from_json(_layout.decode(raw, where, _docs.METADATA), where)
    return dataclasses.replace(doc, listed=listed)


def listed_checksums(location: Location) -> dict[str, str]:
    """The sha256 of each JSON file of the committed checkpoint at ``location``, by name,
    as its commit recorded them (the commit marker's, or the step manifest's, file
    list); an error saying what is there when no commit lists it."""
    raw_marker = location.read_bytes(COMMIT_FILE)
    if raw_marker is not None:
        return dict(CommitMarker.from_bytes(raw_marker, f"{location}/{COMMIT_FILE}").files)
    manifest = _steps.manifest_for_item(location)
    if manifest is None:
        raise not_a_checkpoint(location)
    prefix = f"{location.name}/"
    return {k[len(prefix) :]: v for k, v in manifest.files.items() if k.startswith(prefix)}


def read_listed(location: Location, name: str, *, listed: dict[str, str] | None = None) -> bytes:
    """The bytes of the JSON file ``name`` of a committed checkpoint, checked against
    the sha256 its commit recorded (``listed``: :func:`listed_checksums`, when read;
    else read here); CorruptCheckpointError when it is unlisted, missing or changed."""
    where = f"{location}/{name}"
    expected = (listed if listed is not None else listed_checksums(location)).get(name)
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
