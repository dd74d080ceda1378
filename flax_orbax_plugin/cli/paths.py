"""What a PATH argument names (a run, a step, an item, a core checkpoint), its items."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from .._errors import CheckpointError
from .._format import layout as _layout
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


def resolve(
    path: str, step: int | None, item: str | None = None, *, default: str | None = None
) -> tuple[str, list[Item]]:
    """(label, items) for PATH: a core checkpoint, a step, an item, or a directory;
    ``step`` and ``item`` (or ``default``) choose, a CliError where PATH already did."""
    loc = Location.from_path(path)
    if loc.exists(COMMIT_FILE):
        _only(loc, "a core checkpoint (one pytree, no steps or items)", step, None, item, None)
        return str(loc), [Item(loc.name, loc, "pytree")]
    if loc.exists(MANIFEST_FILE):
        _only(loc, "one step", step, _number(loc), None, None)
        label, items = str(loc), step_items(loc)
    elif (manifest := _layout.manifest_for_item(loc)) is not None:
        name, entry = next((n, e) for n, e in manifest.items.items() if e.dir == loc.name)
        _only(loc, f"item {name!r} of one step", step, _number(loc.parent), item, name)
        return str(loc.parent), [Item(name, loc, entry.kind)]
    else:
        listing = _steps.list_directory(loc)
        if not listing.committed:
            raise CliError(describe_missing(loc, listing))
        if step is not None:
            chosen = _steps.choose_step(loc, listing.committed, step)
            label, items = _step_items_of(loc, chosen)
        else:  # the latest that can be read: a step the environment shuts is named
            for shut, why in listing.unreadable:
                if shut > listing.committed[-1]:
                    _steps.warn_unreadable(loc, shut, why)
            read = partial(_step_items_of, loc)
            label, items = _steps.newest_readable(loc, listing.committed, read)
    item = default if item is None else item
    if item is None:
        return label, items
    picked = [i for i in items if i.name == item]
    if not picked:
        raise CliError(f"{label} has no item {item!r} (it has: {', '.join(i.name for i in items)})")
    return label, picked


def names_one(loc: Location) -> str | None:
    """In words, the one checkpoint ``loc`` names rather than a run; None otherwise."""
    if loc.exists(COMMIT_FILE):
        return "a core checkpoint"
    if loc.exists(MANIFEST_FILE):
        return "one step"
    return None if _layout.manifest_for_item(loc) is None else "an item of one step"


def _number(loc: Location) -> int | None:
    return int(loc.name) if _steps.is_step_name(loc.name) else None


def _only(loc, what, step, own_step, item, own_item) -> None:
    """Refuses ``--step`` / ``--item`` values that PATH (``what``) already decides."""
    if step is not None and step != own_step:
        raise CliError(
            f"--step {step}: {loc} is {what}; --step chooses among the steps of a run "
            f"directory (give the run directory, or leave --step out)"
        )
    if item is not None and item != own_item:
        raise CliError(
            f"--item {item}: {loc} is {what}; --item chooses among the items of a step "
            f"(give the step or the run directory, or leave --item out)"
        )


def describe_missing(loc: Location, listing: _steps.Listing) -> str:
    """What ``loc`` holds instead of committed steps, in the library's words."""
    if loc.exists(METADATA_FILE) and not loc.exists(COMMIT_FILE):
        return f"{loc} is a core checkpoint that was never committed (its save died)"
    return one_line(_steps.no_steps(loc, listing))


def _step_items_of(loc: Location, step: int) -> tuple[str, list[Item]]:
    step_loc = _steps.step_location(loc, step)
    return str(step_loc), step_items(step_loc)


def step_items(step_loc: Location) -> list[Item]:
    manifest = _layout.read_manifest(step_loc)
    return [Item(n, step_loc.child(e.dir), e.kind) for n, e in sorted(manifest.items.items())]


def dir_bytes(loc: Location) -> int | None:
    """Bytes stored under ``loc`` (a local walk or a store's listing), or None."""
    if loc.is_local:
        return loc.size_bytes()
    copier, _ = _server_copy.copier_for(loc)
    if copier is None:
        return None
    try:
        return sum(info.size for info in copier.list(loc.path).values())
    except _server_copy.CopyError:
        return None


JSON_KINDS = ("json", "step", "data_iterator")  # items whose value is one JSON file


def read_json_item(item: Item) -> Any:
    data_iterator = item.kind == "data_iterator"
    name = _layout.iterator_state_file(0) if data_iterator else _layout.JSON_VALUE_FILE
    return _layout.read_item_json(item.loc, name)


def load_extras(step_loc: Location) -> dict[str, Any]:
    try:
        entry = _layout.read_manifest(step_loc).items.get("extras")
        if entry is None:
            return {}
        value = _layout.read_item_json(step_loc.child(entry.dir), _layout.JSON_VALUE_FILE)
    except CheckpointError:
        return {}
    return value if isinstance(value, dict) else {}
