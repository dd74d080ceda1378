"""Housekeeping of a directory of steps: what a manager checks and clears at open, and
the options every process must open a writer with. Training thread (open, gc, delete).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.housekeeping``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from .._base import distributed as _distributed
from .._core import ownership as _ownership
from .._core import removing as _removing
from .._core import writer_liveness as _liveness
from .._errors import CheckpointError, CheckpointNotFoundError, CoordinationError
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import MANIFEST_FILE
from .._storage import lease as _lease
from .._storage.location import Location
from .._storage.lock import DirectoryLock

logger = logging.getLogger("flax_orbax_plugin")


def refuse_step_directory(loc: Location) -> None:
    """Raises CheckpointError when ``loc`` is a file, a step or a core checkpoint."""
    path = loc.path.rstrip("/")
    if loc.is_local and os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(
            f"{loc} is a file, not a directory of steps" + _steps.foreign_format_hint(loc)
        )
    for marker, what in (
        (MANIFEST_FILE, "a committed step"),
        (_layout.COMMIT_FILE, "a core checkpoint"),
        (_layout.METADATA_FILE, "a core checkpoint"),
    ):
        if loc.exists(marker):
            raise CheckpointError(
                f"{loc} is itself {what} (it holds {marker}), not a directory of "
                f"steps; give the directory that holds the steps"
            )


def open_writer(
    loc: Location, *, own: bool = False, region: _distributed.Region
) -> DirectoryLock | _lease.Lease | None:
    """A writer's open, on every process, in ``region``: the primary's lock (or lease) and
    removal of dead saves' remains, then one meeting. Returns the lock or lease held."""
    dir_lock = None
    if loc.is_local and (own or _distributed.is_primary()):
        # One writer per directory: the primary holds the lock for all processes of a run.
        made = not os.path.isdir(loc.path)
        loc.makedirs()
        dir_lock = DirectoryLock(loc.path, made_directory=made)
        try:
            dir_lock.acquire()
        except BaseException:
            dir_lock.discard()  # the directory this open made, if empty
            raise
    elif own or _distributed.is_primary():  # object stores: a lease (``_storage.lease``)
        dir_lock = _lease.take(loc)
    try:
        if own or _distributed.is_primary():
            remove_unfinished(loc)
        region.session_nonce()  # collective once; later names need none
        region.barrier(region.next_operation_id("manager-open"))
    except BaseException:
        if dir_lock is not None:
            dir_lock.discard()  # a refused open leaves no lock file it created
        raise
    return dir_lock


def remove_unfinished(loc: Location, *, warn: bool = True) -> dict[str, str]:
    """Primary, at open and in ``gc``: removes what dead saves of ours left; returns
    ``{name: error}`` of those it could not remove (WARNING each, so the run still opens)."""
    listing = _steps.list_directory(loc)
    stuck: dict[str, str] = {}
    for name in listing.unfinished:
        if _live(loc, name):
            continue
        if not roll_forward(loc, name, listing):
            _, why = _removing.remove_leftover(loc.child(name), what="unfinished step")
            if why is not None:
                stuck[name] = why
    foreign = _remove_dead_staging(loc, listing, stuck)
    if foreign and warn:
        logger.warning(
            "%s holds entries that are not steps of this library, left alone: %s",
            loc,
            ", ".join(foreign[:10]),
        )
    return stuck


def _remove_dead_staging(loc: Location, listing: Any, stuck: dict[str, str]) -> list[str]:
    """The foreign entries of ``listing`` less the dead staging removed."""
    foreign = list(listing.foreign)
    kinds = loc.child_kinds() if loc.is_local else {}
    for name in listing.foreign:
        if loc.is_local:  # a core save's staging beside its target (``<name>.partial-*``)
            if kinds.get(name) != "dir" or not _steps.SAVE_STAGING_RE.match(name):
                continue
            if not _liveness.is_dead(loc.child(name)):
                continue  # its save may still run: not ours to touch yet
            what = "staging of an interrupted save"
        elif _steps.is_step_name(name) and not _live(loc, name):
            what = "uncommitted step"  # object stores: a step written in place, never committed
        else:
            continue
        gone, why = _removing.remove_leftover(loc.child(name), what=what)
        if gone or why is not None:  # (never both)
            foreign.remove(name)
        if why is not None:
            stuck[name] = why
    return foreign


def _live(loc: Location, name: str) -> bool:
    """Whether ``name``'s save still runs on this host (left alone, with a WARNING)."""
    writer = _liveness.writer_alive(loc.child(name))
    if writer is not None:
        logger.warning(
            "%s: unfinished step %s left alone: its save is still running (%s)", loc, name, writer
        )
    return writer is not None


def rolls_forward(loc: Location, name: str, listing: _steps.Listing) -> bool:
    """Whether unfinished ``name`` is a replacement to finish (a crash between its renames)."""
    step_name, _, kind = name.partition(".")  # (a step written in place has no kind)
    if not kind.startswith("partial-") or int(step_name) in listing.committed:
        return False
    try:
        _layout.read_manifest(loc.child(name))
    except CheckpointError:
        return False
    return True


def roll_forward(loc: Location, name: str, listing: _steps.Listing) -> bool:
    """Finishes the commit of unfinished ``name`` where :func:`rolls_forward`."""
    if not rolls_forward(loc, name, listing):
        return False
    step_name = name.partition(".")[0]
    loc.child(name).rename(loc.child(step_name))
    _ownership.unclaim(loc.child(step_name))  # killed before its own unclaim
    logger.warning("finished the commit of step %s in %s (was %s)", step_name, loc, name)
    return True


def remove_committed(loc: Location, steps: list[int], committed: list[int]) -> None:
    """``CheckpointManager.delete``: ``steps`` removed, each checked among ``committed`` first."""
    missing = [step for step in steps if step not in committed]
    if missing:
        raise CheckpointNotFoundError(
            f"{', '.join(map(str, missing))}: no committed step of {loc} "
            f"(its steps: {committed}); nothing was removed"
        )
    for step in steps:
        _removing.remove_step(loc, step)


def saved_at(loc: Location, steps: list[int]) -> float | None:
    """When the latest of ``steps`` was saved (its manifest's time); None if unreadable."""
    if not steps:
        return None
    try:
        return _layout.read_manifest(_steps.step_location(loc, steps[-1])).time
    except CheckpointError:
        return None


# ManagerOptions field -> the public name a user sees in the error.
SHARED = {
    "policy": "the save policy (every_steps=, every_seconds=, policy=, ...)",
    "retention": "the retention (keep=, keep_every=, keep_best=, retention=, ...)",
    "tier": "persistent=",
    "overrides": "checkpointables= / compression=",
    "supersede": "supersede=",
    "handle_sigterm": "handle_sigterm=",
    "incremental": "incremental=",
    "format_version": "format_version=",
    "stall_timeout": "stall_timeout=",
    "hf_shards": "hf_shards=",
}


def _describe(value: Any) -> Any:
    """``value`` as JSON, equal on two processes exactly when the option is."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {  # a clock is each host's own (the primary decides a time policy)
            f.name: _describe(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.name != "clock"
        }
        return {"type": type(value).__qualname__, **fields}
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, range):  # steps=range(...): kept as a range, never listed
        return {"type": "range", "start": value.start, "stop": value.stop, "step": value.step}
    if isinstance(value, (set, frozenset)):
        return sorted((_describe(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if inspect.isroutine(value) or isinstance(value, type):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    simple = (str, int, float, bool, type(None))
    public = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("_")}
    plain = {k: v for k, v in public.items() if isinstance(v, simple)}
    return {"type": type(value).__qualname__, **plain}


def shared_view(opts: Any) -> dict[str, Any]:
    return {field: _describe(getattr(opts, field)) for field in SHARED}


def check_same_options(opts: Any, region: _distributed.Region) -> None:
    """Collective (a writer's open): each option whose :func:`shared_view` differs, refused."""
    if _distributed.process_count() == 1:
        return
    views = region.gather_json("manager-options", shared_view(opts))
    differ = []
    for field, label in SHARED.items():
        values = [json.dumps(v[field], sort_keys=True) for v in views]
        if len(set(values)) > 1:
            short = [v if len(v) <= 160 else v[:157] + "..." for v in values]
            each = "; ".join(f"process {p}: {v}" for p, v in enumerate(short))
            differ.append(f"{label} differs ({each})")
    if differ:
        raise CoordinationError(
            f"{opts.location}: the processes opened this manager with different options: "
            f"{'. '.join(differ)}. Every process must pass the same (each would save, delete "
            f"or write steps the others do not)"
        )
