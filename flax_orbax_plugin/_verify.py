"""``verify``: check everything restore depends on, and report every damaged piece.

For a directory of steps, every committed step (or one) is checked item by item and a
damaged step never stops the others: its manifest (checksum, fields), every JSON file
it lists (present, checksum), every file each item kind needs (``value.json`` of
``step``/``extras``, one iterator state per saving process), and every pytree item
read in full (metadata checksum and fields, ``zarr.json`` agreement, every chunk's
crc32c). A standalone core checkpoint is checked the same way.

Safe to call while a writer works on the directory (it writes nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import _restore, _steps
from ._errors import CheckpointError, CheckpointNotFoundError
from ._layout import COMMIT_FILE, JSON_VALUE_FILE, MANIFEST_FILE, METADATA_FILE, StepManifest
from ._storage import Location

__all__ = ["VerifyResult", "verify"]


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """The verdict on one checkpoint piece: a step's item (``step``, ``item`` set), a
    whole step whose manifest is unreadable (``item`` None), or a core checkpoint."""

    path: str
    step: int | None
    item: str | None
    ok: bool
    error: str | None = None


def verify(path: Any, *, step: int | None = None, all_steps: bool = False) -> list[VerifyResult]:
    """Verifies ``path``: a directory of steps (its latest step, ``step``, or with
    ``all_steps`` every committed step), one step, one item of a step, or a standalone
    core checkpoint. Returns one :class:`VerifyResult` per piece; never raises for
    damage (only :class:`CheckpointNotFoundError` when nothing checkable is there).
    """
    loc = Location.from_path(path)
    if loc.exists(COMMIT_FILE):
        return [_verify_pytree(loc, None, None)]
    if loc.exists(MANIFEST_FILE):
        return verify_step(loc, _step_number(loc))
    if loc.exists(METADATA_FILE) or _steps.manifest_for_item(loc) is not None:
        return [_verify_pytree(loc, _step_number(loc.parent), loc.name)]
    listing = _steps.list_directory(loc)
    if not listing.committed:
        raise CheckpointNotFoundError(f"nothing to verify at {loc}: no committed checkpoint")
    chosen = listing.committed if all_steps else [_steps.choose_step(loc, listing.committed, step)]
    out: list[VerifyResult] = []
    for s in chosen:
        out.extend(verify_step(_steps.step_location(loc, s), s))
    return out


def _step_number(loc: Location) -> int | None:
    return int(loc.name) if _steps.is_step_name(loc.name) else None


def verify_step(step_loc: Location, step: int | None) -> list[VerifyResult]:
    """Every item of one step; a bad manifest is one failed result for the step."""
    try:
        manifest = _steps.read_manifest(step_loc)
    except CheckpointError as e:
        return [VerifyResult(str(step_loc), step, None, False, str(e))]
    out = []
    for name, entry in manifest.items.items():
        item_loc = step_loc.child(entry.dir)
        try:
            _check_item_files(item_loc, name, entry.kind, manifest)
        except CheckpointError as e:
            out.append(VerifyResult(str(item_loc), step, name, False, str(e)))
            continue
        if entry.kind == "pytree":
            out.append(_verify_pytree(item_loc, step, name))
        else:
            out.append(VerifyResult(str(item_loc), step, name, True))
    return out


def _required_files(kind: str, manifest: StepManifest) -> list[str]:
    if kind == "pytree":
        return [METADATA_FILE]
    if kind in ("json", "step"):
        return [JSON_VALUE_FILE]
    if kind == "data_iterator":
        return [f"process_{p}.json" for p in range(manifest.process_count)]
    return []


def _check_item_files(item_loc: Location, name: str, kind: str, manifest: StepManifest) -> None:
    prefix = f"{item_loc.name}/"
    listed = [f[len(prefix) :] for f in manifest.files if f.startswith(prefix)]
    for needed in _required_files(kind, manifest):
        if needed not in listed:
            raise CheckpointError(
                f"item {name!r} ({kind}): the step manifest lists no {needed}; expected one "
                f"for every {kind} item"
            )
    for file in listed:
        if file != METADATA_FILE:  # read with its pytree below
            _steps.read_item_json(item_loc, file)


def _verify_pytree(loc: Location, step: int | None, item: str | None) -> VerifyResult:
    try:
        _restore.restore(loc, None)
    except CheckpointError as e:
        return VerifyResult(str(loc), step, item, False, str(e))
    return VerifyResult(str(loc), step, item, True)
