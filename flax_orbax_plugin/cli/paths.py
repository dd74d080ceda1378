"""Path resolution: what a PATH argument names (a directory of steps, one step, one
checkpointable, a core checkpoint) on any store, and the items found there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._errors import CheckpointError
from .._format import layout as _layout
from .._format import places as _places
from .._format import steps as _steps
from .._format.layout import COMMIT_FILE, MANIFEST_FILE, METADATA_FILE
from .._storage import server_copy as _server_copy
from .._storage.location import Location
from .output import CliError, one_line


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    loc: Location
    kind: str  # "pytree", "json", "step", "data_iterator", ...


def resolve(path: str, step: int | None) -> tuple[str, list[Item]]:
    """(label, items) for PATH: a core checkpoint, a step, an item, or a directory."""
    loc = Location.from_path(path)
    if loc.exists(COMMIT_FILE):
        return str(loc), [Item(loc.name, loc, "pytree")]
    if loc.exists(MANIFEST_FILE):
        return str(loc), step_items(loc)
    manifest = _steps.manifest_for_item(loc)
    if manifest is not None:
        name, entry = next((n, e) for n, e in manifest.items.items() if e.dir == loc.name)
        return str(loc.parent), [Item(name, loc, entry.kind)]
    listing = _steps.list_directory(loc)
    if not listing.committed:
        raise CliError(describe_missing(loc, listing))
    chosen = _steps.choose_step(loc, listing.committed, step)
    step_loc = _steps.step_location(loc, chosen)
    return str(step_loc), step_items(step_loc)


def describe_missing(loc: Location, listing: _steps.Listing) -> str:
    """What ``loc`` holds instead of committed steps, in the library's words."""
    if loc.exists(METADATA_FILE) and not loc.exists(COMMIT_FILE):
        return f"{loc} is a core checkpoint that was never committed (its save died)"
    return one_line(_places.no_steps(loc, listing))


def step_items(step_loc: Location) -> list[Item]:
    manifest = _steps.read_manifest(step_loc)
    return [Item(n, step_loc.child(e.dir), e.kind) for n, e in sorted(manifest.items.items())]


def dir_bytes(loc: Location) -> int | None:
    """Bytes stored under ``loc``: a local walk, or the sizes an object store's listing
    reports (S3 through botocore, GCS through its JSON API); None where neither can be
    had (no client installed, a listing refused)."""
    if loc.is_local:
        return loc.size_bytes()
    copier, _ = _server_copy.copier_for(loc)
    if copier is None:
        return None
    try:
        return sum(info.size for info in copier.list(loc.path).values())
    except _server_copy.CopyError:
        return None


def read_json_item(item: Item) -> Any:
    data_iterator = item.kind == "data_iterator"
    name = _layout.iterator_state_file(0) if data_iterator else _layout.JSON_VALUE_FILE
    return _steps.read_item_json(item.loc, name)


def load_extras(step_loc: Location) -> dict[str, Any]:
    try:
        entry = _steps.read_manifest(step_loc).items.get("extras")
        if entry is None:
            return {}
        value = _steps.read_item_json(step_loc.child(entry.dir), _layout.JSON_VALUE_FILE)
    except CheckpointError:
        return {}
    return value if isinstance(value, dict) else {}
