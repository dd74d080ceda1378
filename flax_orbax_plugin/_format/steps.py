"""Steps of a checkpoint directory and their manifests, what a place holds (``classify``)
and, in words, what it holds when it is not what a caller asked for (only a failing call
or a writer's check of its output runs those), and the checked reads of
``_METADATA.json`` (``read_document``); last, a host's own copy of a step (its marker
``HOST_FILE`` read and checked, and what it holds). Reads names and small files only,
never following a link; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.steps``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._base.env import Option
from .._base.shown import outside_stacklevel
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotCommittedError,
)
from .._storage import local_files as _local_files
from .._storage.location import Location
from . import layout as _layout
from .foreign import foreign_format_hint, is_msgpack_checkpoint, is_orbax_checkpoint
from .layout import (
    COMMIT_FILE,
    HOST_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
    PENDING_FILE,
    STEP_NAME,
    STEP_RE,
    ArrayStorage,
    BatchStorage,
    CheckpointDocument,
    ItemEntry,
    StepManifest,
    iterator_state_file,
    manifest_for_item,
    read_manifest,
)

MAX_STEP = 10**18 - 1  # the largest step a step directory's name holds (STEP_RE)
STEPS = f"an int step in [0, {MAX_STEP}]"  # what a step option takes, in its errors
# The step option, declared once: every entry point that takes a step checks it so.
STEP = Option("step", "int", low=0, high=MAX_STEP, expected=STEPS)
STEP_OR_NONE = Option(
    "step", "int", none_ok=True, low=0, high=MAX_STEP, expected=f"{STEPS} or None"
)
TMP_RE = re.compile(rf"^{STEP_NAME}\.(partial|deleting)-[0-9a-z]{{1,32}}$", re.ASCII)
# The staging of a core save (``fop.save(<dir>/<name>)``), beside its target: not a step.
SAVE_STAGING_RE = re.compile(r"^[^/]+\.(partial|deleting)-[0-9a-z]{1,32}$", re.ASCII)
CORRUPT_RE = re.compile(rf"^{STEP_NAME}\.corrupt-[0-9a-z]{{1,32}}$", re.ASCII)
# Records of ours at the top of a directory (writer lock, run owner, damaged persistent
# copies): never steps, never foreign (named here: their writers sit above this module).
RECORD_NAMES = frozenset({".writer.lock", "_RUN.json", "_DAMAGED.json"})


def is_step_name(name: str) -> bool:
    return bool(STEP_RE.match(name))


def in_host_copy(item_loc: Location) -> bool:
    """Whether the item at ``item_loc`` is in a local step marked as one host's copy."""
    parent = item_loc.parent
    return item_loc.is_local and is_step_name(parent.name) and parent.exists(HOST_FILE)


@dataclasses.dataclass(frozen=True)
class Listing:
    """What a directory holds, by names (and manifest markers)."""

    committed: tuple[int, ...]
    unfinished: tuple[str, ...]
    corrupt: tuple[str, ...]
    foreign: tuple[str, ...]
    # ``(step, why)`` an environmental error kept shut: neither committed nor damaged
    unreadable: tuple[tuple[int, str], ...] = ()

    @property
    def latest(self) -> int | None:
        return self.committed[-1] if self.committed else None


def list_directory(loc: Location) -> Listing:
    """Lists ``loc`` without following symlinks; reads no file contents."""
    committed, unfinished, corrupt, foreign, unreadable = [], [], [], [], []
    if loc.is_local:
        kinds = loc.child_kinds()  # from the entries: no link followed
        names = loc.list_children()
        holds = lambda name, file: loc.child(name).exists(file)
    else:  # an object store: one listing of every key says which steps hold which
        kinds, keys = None, set(loc.keys())  # marker (never a read per step: its cost
        names = sorted({k.split("/", 1)[0] for k in keys} - {""})  # grew with the steps)
        holds = lambda name, file: f"{name}/{file}" in keys
    for name in names:
        if name in RECORD_NAMES or name.startswith(".fop-visible-"):  # _shared_dir's probe
            continue
        if kinds is not None and kinds.get(name) != "dir":
            foreign.append(name)  # a symlink, a file, a device: never ours to follow
            continue
        try:
            manifest = STEP_RE.match(name) and holds(name, MANIFEST_FILE)
        except OSError as e:  # a step folder shut by the environment: said, not fatal
            if not environmental(e):
                raise
            unreadable.append((int(name), f"cannot be read: {e}"))
            continue
        if manifest:
            committed.append(int(name))
        elif TMP_RE.match(name) or (STEP_RE.match(name) and holds(name, PENDING_FILE)):
            # (a step written in place on an object store, its writer killed: gc's too)
            unfinished.append(name)
        elif CORRUPT_RE.match(name):
            corrupt.append(name)
        else:
            foreign.append(name)
    lists = (sorted(committed), unfinished, corrupt, foreign, sorted(unreadable))
    return Listing(*map(tuple, lists))


def committed_steps(loc: Location, listing: Listing | None = None) -> list[int]:
    """The committed steps of ``loc``, ascending; a step folder shut is left out, warned of."""
    listing = listing if listing is not None else list_directory(loc)
    for step, why in listing.unreadable:
        warn_unreadable(loc, step, why)
    return list(listing.committed)


def environmental(error: BaseException) -> bool:
    """Whether ``error`` is the environment's (an OSError not ours): it proves no damage."""
    return isinstance(error, OSError) and not isinstance(error, CheckpointError)


def warn_unreadable(loc: Location, step: int, why: _W) -> _W:
    """Warns that an environmental error ``why`` kept ``loc``'s step ``step`` shut; returns it."""
    text = str(why)
    text = text if text.startswith("cannot be read") else f"cannot be read: {text}"
    warnings.warn(
        f"step {step} of {loc} {text[:500]}; skipped for the latest step (an error of the "
        f"environment, not damage: nothing was moved or removed)",
        UserWarning,
        stacklevel=outside_stacklevel(),
    )
    return why


_T = TypeVar("_T")
_W = TypeVar("_W")


def newest_readable(loc: Location, steps: Sequence[int], read: Callable[[int], _T]) -> _T:
    """``read(step)`` of the newest of ``steps`` (ascending) not shut by an environmental
    error (warned of, skipped); damage propagates; all shut: the newest one's error."""
    if not steps:
        raise CheckpointNotFoundError(f"no committed steps in {loc}{foreign_format_hint(loc)}")
    first: OSError | None = None
    for step in reversed(steps):
        try:
            return read(step)
        except OSError as e:
            if not environmental(e):
                raise
            first = first or e
            warn_unreadable(loc, step, e)
    assert first is not None
    raise first


def choose_step(loc: Location, steps: list[int] | tuple[int, ...], step: int | None) -> int:
    """``step`` if committed, or the latest; CheckpointNotFoundError naming what exists."""
    if not steps:
        raise CheckpointNotFoundError(f"no committed steps in {loc}{foreign_format_hint(loc)}")
    if step is None:
        return steps[-1]
    step = STEP.check(step)
    if step not in steps:
        raise CheckpointNotFoundError(f"step {step} does not exist in {loc}; steps: {list(steps)}")
    return step


def checked_step(step: Any) -> int:
    return STEP.check(step)


def step_location(loc: Location, step: int) -> Location:
    return loc.child(_layout.step_dir(step))


def manifest_damage(loc: Location, step: int) -> CheckpointError | None:
    """Why the manifest of committed ``step`` of ``loc`` does not read whole (None: it does)."""
    try:
        read_manifest(step_location(loc, step))
    except CheckpointError as e:
        return e
    return None


def write_manifest(step_loc: Location, manifest: StepManifest) -> None:
    step_loc.write_bytes(MANIFEST_FILE, manifest.to_bytes())


@dataclasses.dataclass(frozen=True)
class StepItem:
    """An item of a committed step: its name, kind and the step's manifest."""

    location: Location
    name: str
    entry: ItemEntry
    manifest: StepManifest

    @property
    def is_pytree(self) -> bool:
        return self.entry.kind == "pytree"

    @property
    def label(self) -> str:
        return f"item {self.name!r} ({self.entry.kind}) of step {self.manifest.step}"


def step_item(location: Location) -> StepItem | None:
    """The item of a committed step at ``location``, or None (a damaged manifest raises)."""
    manifest = manifest_for_item(location)
    if manifest is None:
        return None
    name, entry = next((n, e) for n, e in manifest.items.items() if e.dir == location.name)
    return StepItem(location, name, entry, manifest)


MAX_PROBED = 16  # children looked into for a run or checkpoint one level down
PATHS_NAMED = 4  # items of a step named when pointing at them
_STAGING_FILES = (METADATA_FILE, PENDING_FILE)  # what a save of ours leaves before its commit


# The kinds of a Place: what a path holds.
CHECKPOINT = "checkpoint"  # one pytree of ours, written by fop.save (its commit marker)
STEP_KIND = "step"  # a committed step of a run directory (its manifest)
HOST_COPY = "host copy"  # one host's own copy of a step (its manifest and host marker)
ITEM = "item"  # a pytree item of a committed step (listed in the step's manifest)
JSON_ITEM = "JSON item"  # an item of a committed step that holds no pytree (JSON)
RUN = "run"  # a run directory of ours: committed steps, or our run records
ORBAX = "Orbax"  # an Orbax item, step or run (``foreign.is_orbax_checkpoint``)
MSGPACK = "msgpack"  # a Flax msgpack file
UNFINISHED = "unfinished"  # a save of ours that began and never committed
NOTHING = "nothing"  # none of the above (a file, an empty or missing place, others')
PYTREES = (CHECKPOINT, ITEM)  # what the native reader reads


@dataclasses.dataclass(frozen=True)
class Place:
    """What is at ``location`` (:func:`classify`): its ``kind`` and what the probes found."""

    location: Location
    kind: str
    item: StepItem | None = None
    listing: Listing | None = None
    staged: str | None = None

    @property
    def description(self) -> str:
        """What is there, in words, for messages."""
        loc = self.location
        if self.kind == CHECKPOINT:
            return f"the checkpoint {loc} (written by fop.save)"
        if self.kind == STEP_KIND:
            return f"step {loc.name} of the run directory {loc.parent}"
        if self.kind == HOST_COPY:
            return f"one host's own copy of step {loc.name} ({loc})"
        if self.item is not None:
            return f"{self.item.label} ({loc})"
        if self.kind == RUN:
            latest = None if self.listing is None else self.listing.latest
            steps = "no committed step yet" if latest is None else f"latest step {latest}"
            return f"the run directory {loc} ({steps})"
        if self.kind == ORBAX:
            return f"an Orbax checkpoint at {loc}"
        if self.kind == MSGPACK:
            return f"a Flax msgpack checkpoint at {loc}"
        if self.kind == UNFINISHED:
            return f"{loc}, whose save was interrupted or is still running"
        return f"no checkpoint at {loc}"


def classify(location: Location, *, steps_first: bool = False) -> Place:
    """What is at ``location``, probed in this order: ours, a step, an item, Orbax, a run,
    an unfinished save, msgpack, nothing. ``steps_first``: list first (errors propagate)."""
    listing = list_directory(location) if steps_first else None
    if listing is not None and listing.committed:
        return Place(location, RUN, listing=listing)
    if location.exists(COMMIT_FILE):
        return Place(location, CHECKPOINT, listing=listing)
    if location.exists(MANIFEST_FILE):
        kind = HOST_COPY if location.exists(HOST_FILE) else STEP_KIND
        return Place(location, kind, listing=listing)
    item = step_item(location)
    if item is not None:
        return Place(location, ITEM if item.is_pytree else JSON_ITEM, item=item, listing=listing)
    if is_orbax_checkpoint(location):
        return Place(location, ORBAX, listing=listing)
    run = _run_listing(location, listing)
    if run is not None:
        return Place(location, RUN, listing=run)
    staged = _staged(location)
    if staged is not None:
        return Place(location, UNFINISHED, listing=listing, staged=staged)
    if location.is_local and is_msgpack_checkpoint(location.path.rstrip("/")):
        return Place(location, MSGPACK, listing=listing)
    return Place(location, NOTHING, listing=listing)


def _run_listing(location: Location, listing: Listing | None) -> Listing | None:
    """The listing of ``location`` if it is a run of ours (steps or run records), else None."""
    with contextlib.suppress(CheckpointError, OSError):
        if location.is_local and not location.is_dir():
            return None
        listing = listing if listing is not None else list_directory(location)
        if listing.committed or any(location.exists(n) for n in RECORD_NAMES):
            return listing
    return None


def not_a_checkpoint(where: Location | Place) -> CheckpointError:
    """The error for a reader of one pytree that found none at ``where`` (a Place or location)."""
    place = where if isinstance(where, Place) else classify(where)
    location = place.location
    if place.kind in (STEP_KIND, HOST_COPY):
        return CheckpointError(
            f"{location} is a step of a checkpoint directory, not one pytree: restore one of "
            f"its items ({_step_items(location)}) or use CheckpointManager / restore_params"
        )
    if place.kind == RUN:
        return CheckpointNotFoundError(_run_directory_message(location, place.listing))
    if place.kind == UNFINISHED:
        return NotCommittedError(
            f"{location} is not a committed checkpoint: its save was interrupted or is "
            f"still running"
        )
    return CheckpointNotFoundError(nothing_here(location, "no checkpoint"))


def _step_items(step: Location) -> str:
    """The items of the step at ``step`` as paths, pytrees first."""
    try:
        items = read_manifest(step).items
    except CheckpointError as e:  # a damaged manifest: say so, name no item
        return f"its manifest is damaged: {e}"
    ordered = sorted(items.items(), key=lambda kv: (kv[1].kind != "pytree", kv[0]))
    shown = [str(step.child(entry.dir)) for _, entry in ordered[:PATHS_NAMED]]
    more = len(ordered) - len(shown)
    return (", ".join(shown) or "none") + (f" and {more} more" if more > 0 else "")


def nothing_here(location: Location, none: str) -> str:
    """``none`` (what was looked for) and what ``location`` holds instead."""
    hint = foreign_format_hint(location)
    if hint:
        return f"no checkpoint of this library at {location}{hint}"
    path = location.path.rstrip("/")
    if location.is_local and os.path.lexists(path) and not os.path.isdir(path):
        return f"{location} is a file, not a checkpoint directory"
    if not location.is_dir():
        return f"{none} at {location}: the path does not exist" + (
            "" if location.is_local else " (nothing is stored under it)"
        )
    inside = folder_inside(location)
    if inside is not None:
        return f"{none} at {location}: it is a folder inside {inside}; point at that instead"
    names = [n for n in location.list_children() if not n.startswith(".fop-visible-")]
    if not names:
        return f"{none} at {location}: an empty directory (nothing was ever saved here)"
    below = one_level_down(location, names)
    if below:
        return (
            f"{none} at {location} itself; one level down: {'; '.join(below)}. Point at "
            f"{'one of them' if len(below) > 1 else 'it'}"
        )
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "")
    return f"{none} at {location}: it holds no checkpoint of this library (it holds: {shown})"


def folder_inside(location: Location) -> str | None:
    """What of ours ``location`` is a folder inside (a checkpoint, a step, an item)."""
    with contextlib.suppress(CheckpointError, OSError, ValueError):
        parent = location.parent
        if parent.exists(COMMIT_FILE):
            return f"the checkpoint {parent}"
        if parent.exists(MANIFEST_FILE):
            return f"step {parent.name} ({parent})"
        if manifest_for_item(parent) is not None:
            return f"the item {parent} of a step"
    return None


def one_level_down(location: Location, names: list[str], *, runs_only: bool = False) -> list[str]:
    """Runs and checkpoints of ours (``runs_only``: runs) in the first :data:`MAX_PROBED`."""
    kinds = location.child_kinds() if location.is_local else None
    found = []
    for name in [n for n in names if kinds is None or kinds.get(n) == "dir"][:MAX_PROBED]:
        try:
            child = location.child(name)
            if child.exists(COMMIT_FILE):
                what = "a checkpoint of one pytree"
            elif child.exists(MANIFEST_FILE):
                what = "a step of a run directory"
            elif (latest := list_directory(child).latest) is not None:
                what = f"a run directory of CheckpointManager, latest step {latest}"
            elif any(child.exists(n) for n in RECORD_NAMES):
                what = "a run directory of CheckpointManager, no committed step yet"
            else:
                continue
        except (CheckpointError, OSError, ValueError):
            continue  # a link, an odd name, an unreadable entry: not pointed at
        if not runs_only or what.startswith("a run directory"):
            found.append(f"{child} ({what})")
    return found


def _run_directory_message(location: Location, listing: Listing | None) -> str:
    """What to call on a run directory (``listing``: its listing, when made)."""
    listing = listing if listing is not None else list_directory(location)
    latest = listing.latest
    if latest is None:
        steps = "no committed step yet"
        item = f"{location}/<step>/params"
    else:
        shown = ", ".join(map(str, listing.committed[-5:]))
        more = "..., " if len(listing.committed) > 5 else ""
        steps = f"steps {more}{shown}"
        try:  # an item the latest step holds (params, unless it has none)
            names = sorted(read_manifest(location.child(str(latest))).items)
        except (CheckpointError, OSError):  # OSError: shut by a permission, an I/O error
            names = []
        item = f"{location}/{latest}/{'params' if 'params' in names or not names else names[0]}"
    if listing.unreadable:  # folders the environment shut: named, not left out unsaid
        shut = ", ".join(str(step) for step, _ in listing.unreadable[:5])
        steps += f"; step folder(s) {shut} cannot be read"
    return (
        f"{location} is a run directory of CheckpointManager ({steps}), not one "
        f"checkpoint: restore a step with fop.CheckpointManager({str(location)!r}, "
        f"read_only=True).restore(like=state) (or CheckpointCallback(..., resume=True)), "
        f"its params alone with fop.restore_params({str(location)!r}, like), or name one "
        f"item of a step: {item!r}"
    )


def _staged(location: Location) -> str | None:
    """A staging file of ours at ``location``, or ``"partial"`` for a staging beside it."""
    found = next((n for n in _STAGING_FILES if location.exists(n)), None)
    if found is not None or not location.is_local:
        return found
    parent = os.path.dirname(location.path.rstrip("/"))
    try:
        names = os.listdir(parent)
    except OSError:
        return None
    return "partial" if fnmatch.filter(names, f"{location.name}.partial-*") else None


def contents(loc: Location, limit: int = 5) -> str:
    """A short list of what ``loc`` holds, for messages."""
    names = loc.list_children()
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    run = "a CheckpointManager's directory of steps: " if committed_steps(loc) else ""
    return f"{run}it holds {shown}" if names else "it is empty"


def holding_checkpoint(location: Location, *, runs: int = 0) -> str | None:
    """The committed checkpoint, step or (the first ``runs`` levels) run of ours that
    ``location`` (a real path) is or lies inside, in words; None when there is none."""
    here, level = location, 0
    while True:
        if here.exists(MANIFEST_FILE):
            return f"step {here.name} of the run directory {here.parent}"
        if here.exists(COMMIT_FILE):
            return f"the checkpoint {here} (written by fop.save)"
        if level < runs and list_directory(here).committed:
            return f"the run directory {here} (it holds committed steps)"
        if here.parent == here:
            return None
        here, level = here.parent, level + 1


def no_steps(where: Location | Place, listing: Listing | None = None) -> CheckpointError:
    """The error for a reader of steps that found none at ``where`` (a Place or location)."""
    place = where if isinstance(where, Place) else classify(where)
    location, listing = place.location, listing or place.listing
    if place.kind in (STEP_KIND, HOST_COPY):
        step = location.name
        return CheckpointNotFoundError(
            f"{location} is step {step} of the run directory {location.parent}, not a run "
            f"directory: name that directory (and step {step}), e.g. "
            f"fop.restore_params({str(location.parent)!r}, step={step})"
        )
    if place.item is not None:
        item = place.item.manifest
        return CheckpointNotFoundError(
            f"{location} is an item of step {item.step} of the run directory "
            f"{location.parent.parent}, not a run directory: fop.restore({str(location)!r}) "
            f"reads it, fop.restore_params({str(location.parent.parent)!r}, step={item.step}) "
            f"serves the step's params"
        )
    if place.kind == CHECKPOINT:
        return CheckpointNotFoundError(
            f"{location} is a checkpoint of one pytree (fop.save), not a directory of "
            f"steps: read it with fop.restore({str(location)!r})"
        )
    listing = listing if listing is not None else list_directory(location)
    if listing.corrupt:  # steps there were, all set aside: damage, not an empty run
        return CorruptCheckpointError(
            f"no committed steps in {location}: every step was set aside as damaged "
            f"({', '.join(listing.corrupt)}); inspect them with `flax-orbax verify "
            f"{location}/<name>`"
        )
    if listing.unfinished:
        return CheckpointNotFoundError(
            f"no committed steps in {location}: the saves of "
            f"{', '.join(listing.unfinished)} were interrupted or are still running"
        )
    if any(location.exists(n) for n in RECORD_NAMES):
        return CheckpointNotFoundError(
            f"no committed steps in {location}: a run directory of CheckpointManager with "
            f"no committed step yet"
        )
    return CheckpointNotFoundError(nothing_here(location, "no committed steps"))


def misplaced(location: Location) -> str | None:
    """Where ``location`` (no run itself) is one level off a run of ours, in words (``gc``)."""
    inside = folder_inside(location)
    if inside is not None:
        return f"{location} is a folder inside {inside}; point at the run directory instead"
    names = [n for n in location.list_children() if not n.startswith(".fop-visible-")]
    below = one_level_down(location, names, runs_only=True)  # a checkpoint there: no gc's
    if below:
        return f"{location} holds no run itself; one level down: {'; '.join(below)}"
    return None


def read_document(location: Location) -> CheckpointDocument:
    """The validated metadata at ``location``, checked against its commit's checksum."""
    return _layout.read_listed_document(location, listed_checksums(location))


def listed_checksums(location: Location) -> dict[str, str]:
    """``layout.committed_checksums`` of ``location``; an error when no commit lists it."""
    listed = _layout.committed_checksums(location)
    if listed is None:
        raise not_a_checkpoint(location)
    return listed


MARKER_FORMAT = "flax_orbax_plugin/host-copy"
COPY_LAYOUT = "copied down: every region"  # the marker's layout of a bucket's step


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def _pair(d: Any) -> bool:
    return isinstance(d, list) and len(d) == 2 and all(map(_is_int, d))


def _short_str(limit: int):
    """The check of a field that is null or a string of at most ``limit`` characters."""
    return lambda v: v is None or isinstance(v, str) and len(v) <= limit


def _held_ok(held: Any) -> bool:
    """``held``: null, or ``{"sets": [[region, ...], ...], "items": {item: {leaf: set}}}``."""
    if held is None:
        return True
    if not isinstance(held, dict) or set(held) != {"sets", "items"}:
        return False
    sets, items = held["sets"], held["items"]
    region_ok = lambda r: isinstance(r, list) and all(_pair(d) and d[0] <= d[1] for d in r)
    if not isinstance(sets, list) or not all(
        isinstance(s, list) and all(map(region_ok, s)) for s in sets
    ):
        return False
    return isinstance(items, dict) and all(
        isinstance(leaves, dict) and all(_is_int(i) and i < len(sets) for i in leaves.values())
        for leaves in items.values()
    )


# field -> (expected, check) of a per-host marker (what per_host.host_marker writes);
# ``held`` may be absent (a marker written before it was)
_MARKER_FIELDS = {
    "format": (repr(MARKER_FORMAT), lambda v: v == MARKER_FORMAT),
    "step": ("a step number", _is_int),
    "run": ("a run id or null", _short_str(64)),
    "process_index": ("a process index", _is_int),
    "process_count": ("a process count", _is_int),
    "devices": (
        "[[device id, process index], ...]",
        lambda v: isinstance(v, list) and all(map(_pair, v)),
    ),
    "layout": ("a layout description or null", _short_str(256)),
    "hosts": (
        "null or a list of digests",
        lambda v: v is None or isinstance(v, list) and all(isinstance(h, str) for h in v),
    ),
    "held": ("null or {'sets': [...], 'items': {...}} (the regions held)", _held_ok),
}


def read_at(step_loc: Location) -> tuple[dict | None, str | None]:
    """The :data:`HOST_FILE` of the step at ``step_loc``, checked, or what is wrong with it."""
    try:
        raw = step_loc.read_bytes(HOST_FILE, max_bytes=_local_files.HOST_MARKER.max_bytes)
        if raw is None:
            return None, f"no {HOST_FILE}"
        doc = _local_files.parse(raw, f"{step_loc}/{HOST_FILE}", _local_files.HOST_MARKER)
    except CheckpointError as e:
        return None, str(e)
    if not isinstance(doc, dict):
        return None, f"{step_loc}/{HOST_FILE}: expected a JSON object, found {type(doc).__name__}"
    for field, (expected, ok) in _MARKER_FIELDS.items():
        if not ok(doc.get(field)):
            found = repr(doc.get(field))[:80]
            return (
                None,
                f"{step_loc}/{HOST_FILE}: field {field}: expected {expected}, found {found}",
            )
    return doc, None


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """One host's copy of a step, as its marker describes it."""

    where: str  # the step's location
    step: int
    process_index: int
    process_count: int
    held: dict | None  # the marker's ``held``: None holds every region

    @property
    def note(self) -> str:
        """What a reader of this copy is told (the verify result's ``note``)."""
        mine = f"process {self.process_index}'s own copy (a directory per host)"
        if self.held is None or not self.held["items"]:
            return f"{mine}, holding every region"
        others = self.process_count - 1
        return f"{mine}: the other {others} host(s)' shards live in their own directories"

    def item(self, name: str) -> HeldItem:
        return HeldItem(self, name)

    def regions(self, item: str, path: str, shape: tuple[int, ...]) -> list[tuple] | None:
        """The regions of leaf ``path`` of ``item`` this copy holds (None: whole), checked."""
        if self.held is None:
            return None
        index = self.held["items"].get(item, {}).get(path)
        if index is None:
            return None
        out = []
        for region in self.held["sets"][index]:
            fits = len(region) == len(shape) and all(
                b <= n for (_, b), n in zip(region, shape, strict=True)
            )
            if not fits:
                raise CorruptCheckpointError(
                    f"{self.where}/{HOST_FILE}: field held: leaf {path!r} of item {item!r} "
                    f"has shape {tuple(shape)}, the marker names the region {region} of it"
                )
            out.append(tuple(slice(a, b) for a, b in region))
        return out

    def partial(self, item: str, records: list) -> list[str]:
        """The paths of ``records`` (of ``item``) this copy does not hold whole."""
        return [r.path for r in records if self.regions(item, r.path, r.shape) is not None]

    def elsewhere(self, kind: str, process_count: int) -> set[str]:
        """Files of an item of ``kind`` held by the other hosts: their data iterator states."""
        if self.held is None or kind != "data_iterator":
            return set()
        others = (p for p in range(process_count) if p != self.process_index)
        return {iterator_state_file(p) for p in others}

    def refusal(self, where: Any, partial: list[str]) -> CheckpointError:
        """The error of a read of ``where`` that needs the leaves ``partial`` whole."""
        shown = ", ".join(repr(p) for p in partial[:3]) + (" ..." if len(partial) > 3 else "")
        return CheckpointError(
            f"{where} is process {self.process_index}'s own copy of step {self.step}, saved "
            f"with a directory per host ({self.process_count} processes): it holds only "
            f"that process's shards of {len(partial)} leaf(s) ({shown}); the other hosts' "
            f"shards live in their own directories. Restore it through the manager on "
            f"every host, or read the persistent tier's copy of the step (it holds every "
            f"shard)"
        )


@dataclasses.dataclass(frozen=True)
class HeldItem:
    """What a host's own copy holds of one item (``verify``'s view of it)."""

    copy: HostCopy
    name: str

    def regions(self, record: Any) -> list[tuple] | None:
        """The regions of ``record``'s leaf held (None: whole; []: none)."""
        return self.copy.regions(self.name, record.path, record.shape)

    def skipped_batches(self, doc: Any) -> set[str]:
        """Batches with a leaf not held whole here (a host writes a batch only if it holds all)."""
        return {
            rec.storage.batch
            for rec in doc.leaves
            if isinstance(rec.storage, BatchStorage) and self.regions(rec) is not None
        }

    def whole(self, record: Any, skipped: set[str]) -> bool:
        """Whether the copy holds ``record``'s leaf whole (``skipped``: :meth:`skipped_batches`)."""
        if isinstance(record.storage, BatchStorage):
            return record.storage.batch not in skipped
        return not isinstance(record.storage, ArrayStorage) or self.regions(record) is None


def held_bytes(regions: list[tuple] | None, shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of ``regions`` (None: the whole ``shape``)."""
    if regions is None:
        return math.prod(shape) * itemsize
    return sum(math.prod(s.stop - s.start for s in r) for r in regions) * itemsize


def of_step(step_loc: Location) -> tuple[HostCopy | None, str | None]:
    """The host copy the local step at ``step_loc`` is (None: no marker), or its marker's fault."""
    if not step_loc.is_local or not step_loc.exists(HOST_FILE):
        return None, None
    doc, problem = read_at(step_loc)
    if doc is None:
        return None, problem
    if is_step_name(step_loc.name) and doc["step"] != int(step_loc.name):
        found = doc["step"]
        return None, f"{step_loc}/{HOST_FILE}: field step: expected {step_loc.name}, found {found}"
    return HostCopy(
        str(step_loc), doc["step"], doc["process_index"], doc["process_count"], doc.get("held")
    ), None


def of_item(item_loc: Location) -> HostCopy | None:
    """:func:`of_step` of ``item_loc``'s step (None where its marker is unreadable: read as any)."""
    return of_step(item_loc.parent)[0]
