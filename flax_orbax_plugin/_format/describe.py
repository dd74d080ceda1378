"""What a place holds when it is not what a caller asked for, in words (the one-pytree
reader's words: ``steps.not_a_checkpoint``). Only a failing call or a writer's check of its
output runs this. Reads names and small files only, never following a link; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.steps``.
"""

from __future__ import annotations

from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .._storage.location import Location
from .layout import COMMIT_FILE, MANIFEST_FILE
from .steps import (
    CHECKPOINT,
    HOST_COPY,
    RECORD_NAMES,
    STEP_KIND,
    Listing,
    Place,
    classify,
    committed_steps,
    folder_inside,
    list_directory,
    nothing_here,
    one_level_down,
)


def contents(loc: Location, limit: int = 5) -> str:
    """A short list of what ``loc`` holds, for the words of a refused removal or write."""
    names = loc.list_children()
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    run = "a CheckpointManager's directory of steps: " if committed_steps(loc) else ""
    return f"{run}it holds {shown}" if names else "it is empty"


def holding_checkpoint(location: Location, *, runs: int = 0) -> str | None:
    """The committed checkpoint of ours that ``location`` (a real path) is or lies inside, in
    words: a step, a core checkpoint, or (``location`` and its first ``runs - 1`` parents)
    a run holding committed steps; None when there is none. For writers' outputs."""
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
    """Where ``location`` (no run itself) is one level off a run of ours: inside a
    checkpoint, step or item, or above runs; None otherwise. ``gc``'s check."""
    inside = folder_inside(location)
    if inside is not None:
        return f"{location} is a folder inside {inside}; point at the run directory instead"
    names = [n for n in location.list_children() if not n.startswith(".fop-visible-")]
    below = one_level_down(location, names, runs_only=True)  # a checkpoint there: no gc's
    if below:
        return f"{location} holds no run itself; one level down: {'; '.join(below)}"
    return None
