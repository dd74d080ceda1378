"""What a place holds when it holds not what a reader asked for: the one describer of
wrong directories, for every reading entry point (``fop.restore``, ``fop.metadata``,
``restore_params``, the CLI's ``inspect``/``verify``/``list``/``export``).

:func:`not_a_checkpoint` answers a reader that wanted one pytree, :func:`no_steps` one
that wanted a directory of steps. Each names what is there: nothing, a file, an empty
directory, a step, a run directory, an interrupted save (a staging place of ours: the
only case called "interrupted"), another library's checkpoint, or runs and checkpoints
one level down (named, so the user can point at them); else what it holds.

Called on error paths only: lists the place and, for the level below, at most
:data:`MAX_PROBED` children. Reads names and small files only; no link is followed
(listing as :mod:`.steps` does). Safe from any thread.
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
from .._storage.location import Location
from . import steps as _steps
from .foreign import foreign_format_hint
from .layout import COMMIT_FILE, MANIFEST_FILE, METADATA_FILE

__all__ = ["MAX_PROBED", "holding_checkpoint", "misplaced", "no_steps", "not_a_checkpoint"]

MAX_PROBED = 16  # children looked into for a run or checkpoint one level down
PATHS_NAMED = 4  # items of a step named when pointing at them
# What a save of ours leaves in its place before it commits: the pending marker (its
# name is the removal owner's, ``_core.ownership``, a wing above: named here) and a
# pytree's metadata written before its commit marker (object stores).
_STAGING_FILES = ("_PENDING.json", METADATA_FILE)


def not_a_checkpoint(location: Location) -> CheckpointError:
    """The error for a reader of one pytree (``fop.restore``, ``fop.metadata``) that
    found no committed checkpoint at ``location``."""
    if location.exists(MANIFEST_FILE):
        return CheckpointError(
            f"{location} is a step of a checkpoint directory, not one pytree: restore one of "
            f"its items ({_step_items(location)}) or use CheckpointManager / restore_params"
        )
    run = _run_directory_message(location)
    if run is not None:
        return CheckpointNotFoundError(run)
    if _staged(location):
        return NotCommittedError(
            f"{location} is not a committed checkpoint: its save was interrupted or is "
            f"still running"
        )
    return CheckpointNotFoundError(_nothing_here(location, "no checkpoint"))


def holding_checkpoint(location: Location, *, runs: int = 0) -> str | None:
    """The committed checkpoint of this library that ``location`` is (or lies inside),
    in words: a step (or a place inside one of its items), a core checkpoint, or, for
    ``location`` and its first ``runs - 1`` parents, a run directory holding committed
    steps. None when there is none. For writers whose output must stay outside every
    checkpoint (an export, an import's run): a committed checkpoint never changes.

    Probes one marker per parent (and lists ``runs`` directories); a local
    ``location`` should be a real path (no link on the way). Safe from any thread."""
    here, level = location, 0
    while True:
        if here.exists(MANIFEST_FILE):
            return f"step {here.name} of the run directory {here.parent}"
        if here.exists(COMMIT_FILE):
            return f"the checkpoint {here} (written by fop.save)"
        if level < runs and _steps.list_directory(here).committed:
            return f"the run directory {here} (it holds committed steps)"
        if here.parent == here:
            return None
        here, level = here.parent, level + 1


def _step_items(step: Location) -> str:
    """The items of the step at ``step`` as paths, pytrees first (it named a ``params``
    item also where the step has none)."""
    try:
        items = _steps.read_manifest(step).items
    except CheckpointError as e:  # a damaged manifest: say so, name no item
        return f"its manifest is damaged: {e}"
    ordered = sorted(items.items(), key=lambda kv: (kv[1].kind != "pytree", kv[0]))
    shown = [str(step.child(entry.dir)) for _, entry in ordered[:PATHS_NAMED]]
    more = len(ordered) - len(shown)
    return (", ".join(shown) or "none") + (f" and {more} more" if more > 0 else "")


def no_steps(location: Location, listing: _steps.Listing | None = None) -> CheckpointError:
    """The error for a reader of a directory of steps (``restore_params``, the CLI) that
    found no committed step in ``location`` (``listing``: its listing, when made)."""
    if location.exists(MANIFEST_FILE):
        step = location.name
        return CheckpointNotFoundError(
            f"{location} is step {step} of the run directory {location.parent}, not a run "
            f"directory: name that directory (and step {step}), e.g. "
            f"fop.restore_params({str(location.parent)!r}, step={step})"
        )
    item = _steps.manifest_for_item(location)
    if item is not None:
        return CheckpointNotFoundError(
            f"{location} is an item of step {item.step} of the run directory "
            f"{location.parent.parent}, not a run directory: fop.restore({str(location)!r}) "
            f"reads it, fop.restore_params({str(location.parent.parent)!r}, step={item.step}) "
            f"serves the step's params"
        )
    if location.exists(COMMIT_FILE):
        return CheckpointNotFoundError(
            f"{location} is a checkpoint of one pytree (fop.save), not a directory of "
            f"steps: read it with fop.restore({str(location)!r})"
        )
    listing = listing if listing is not None else _steps.list_directory(location)
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
    if any(location.exists(n) for n in _steps.RECORD_NAMES):
        return CheckpointNotFoundError(
            f"no committed steps in {location}: a run directory of CheckpointManager with "
            f"no committed step yet"
        )
    return CheckpointNotFoundError(_nothing_here(location, "no committed steps"))


def _nothing_here(location: Location, none: str) -> str:
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
    inside = _inside(location)
    if inside is not None:
        return f"{none} at {location}: it is a folder inside {inside}; point at that instead"
    names = [n for n in location.list_children() if not n.startswith(".fop-visible-")]
    if not names:
        return f"{none} at {location}: an empty directory (nothing was ever saved here)"
    below = _one_level_down(location, names)
    if below:
        return (
            f"{none} at {location} itself; one level down: {'; '.join(below)}. Point at "
            f"{'one of them' if len(below) > 1 else 'it'}"
        )
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "")
    return f"{none} at {location}: it holds no checkpoint of this library (it holds: {shown})"


def misplaced(location: Location) -> str | None:
    """Where ``location`` (no run itself) is one level off a run of ours: a folder inside
    a checkpoint, step or item, or a folder with runs one level down;
    None otherwise (a folder of other things is no mistake of place). ``gc``'s check."""
    inside = _inside(location)
    if inside is not None:
        return f"{location} is a folder inside {inside}; point at the run directory instead"
    names = [n for n in location.list_children() if not n.startswith(".fop-visible-")]
    below = _one_level_down(location, names, runs_only=True)  # a checkpoint there: no gc's
    if below:
        return f"{location} holds no run itself; one level down: {'; '.join(below)}"
    return None


def _inside(location: Location) -> str | None:
    """What of ours ``location`` is a folder inside (a checkpoint, a step, an item)."""
    try:
        parent = location.parent
        if parent.exists(COMMIT_FILE):
            return f"the checkpoint {parent}"
        if parent.exists(MANIFEST_FILE):
            return f"step {parent.name} ({parent})"
        if _steps.manifest_for_item(parent) is not None:
            return f"the item {parent} of a step"
    except (CheckpointError, OSError, ValueError):
        pass
    return None


def _one_level_down(location: Location, names: list[str], *, runs_only: bool = False) -> list[str]:
    """Runs and checkpoints (``runs_only``: runs) of ours among the first
    :data:`MAX_PROBED` children."""
    kinds = location.child_kinds() if location.is_local else None
    found = []
    for name in [n for n in names if kinds is None or kinds.get(n) == "dir"][:MAX_PROBED]:
        try:
            child = location.child(name)
            what = _what_child_is(child)
        except (CheckpointError, OSError, ValueError):
            continue  # a link, an odd name, an unreadable entry: not pointed at
        if what is not None and (not runs_only or what.startswith("a run directory")):
            found.append(f"{child} ({what})")
    return found


def _what_child_is(child: Location) -> str | None:
    if child.exists(COMMIT_FILE):
        return "a checkpoint of one pytree"
    if child.exists(MANIFEST_FILE):
        return "a step of a run directory"
    latest = _steps.list_directory(child).latest
    if latest is not None:
        return f"a run directory of CheckpointManager, latest step {latest}"
    if any(child.exists(n) for n in _steps.RECORD_NAMES):
        return "a run directory of CheckpointManager, no committed step yet"
    return None


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
        try:  # an item the latest step holds (params, unless it has none)
            names = sorted(_steps.read_manifest(location.child(str(latest))).items)
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


def _staged(location: Location) -> bool:
    """Whether a save of ours to ``location`` began and never committed: a staging
    file of ours there, or (local disk) a ``<name>.partial-*`` staging beside it."""
    if any(location.exists(n) for n in _STAGING_FILES):
        return True
    if not location.is_local:
        return False
    parent = os.path.dirname(location.path.rstrip("/"))
    try:
        names = os.listdir(parent)
    except OSError:
        return False
    return bool(fnmatch.filter(names, f"{location.name}.partial-*"))
