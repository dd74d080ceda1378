"""Each host's own local directory: saving, the persistent tier and restore ways of a
manager whose processes each see a directory no other sees.

Collective where they say so: every process calls them in the same order, on the
training thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.per_host``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import time
from collections.abc import Mapping
from typing import Any

import jax

from .._base import distributed as _distributed
from .._base import tree as _tree
from .._core import formats as _formats
from .._core import removing as _removing
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import host_copy as _host_copy
from .._format import steps as _steps
from .._format.layout import HOST_FILE
from .._storage import lease as _lease
from .._storage import local_files as _local_files
from .._storage import shared_dir as _shared_dir
from .._storage.location import Location
from .checkpointables import from_json, to_json

__all__ = [
    "HOST_FILE",
    "agreed_time",
    "host_marker",
    "layout_digest",
    "valid_steps",
]

logger = logging.getLogger("flax_orbax_plugin")

_FORMAT = _host_copy.MARKER_FORMAT
COPY_LAYOUT = _host_copy.COPY_LAYOUT  # the marker's layout of a bucket's step


def device_map() -> list[list[int]]:
    """``[[device id, process index], ...]`` of every device, sorted."""
    return sorted([d.id, d.process_index] for d in jax.devices())


def _array_leaves(items: Mapping[str, Any]):
    """``(name, path, leaf)`` of every jax.Array leaf of ``items``, in a fixed order."""
    for name in sorted(items):
        value = items[name]
        if isinstance(value, str | bytes | int | float) or value is None:
            continue
        try:
            flat, _ = _tree.flatten(value)
        except Exception:  # noqa: BLE001  (a custom item: not a pytree of arrays)
            continue
        for path, _keys, leaf in flat:
            if isinstance(leaf, jax.Array):
                yield name, path, leaf


def layout_digest(items: Mapping[str, Any]) -> str:
    """sha256 over every jax.Array leaf's path, shape, dtype and device -> region map
    (informational, in the marker)."""
    h = hashlib.sha256()
    for name, path, leaf in _array_leaves(items):
        regions = sorted(
            (d.id, tuple((s.start, s.stop) for s in index))
            for d, index in leaf.sharding.devices_indices_map(leaf.shape).items()
        )
        h.update(repr((name, path, leaf.shape, str(leaf.dtype), regions)).encode())
    return h.hexdigest()


def host_regions(items: Mapping[str, Any]) -> list[str]:
    """Per process index, a sha256 over the regions its devices hold of every jax.Array
    leaf (no device ids): two processes with one digest can read each other's copy."""
    count = _distributed.process_count()
    hashes = [hashlib.sha256() for _ in range(count)]
    for name, path, leaf in _array_leaves(items):
        held: list[set] = [set() for _ in range(count)]
        for d, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            held[d.process_index].add(tuple((s.start, s.stop) for s in index))
        for p in range(count):
            what = (name, path, leaf.shape, str(leaf.dtype), sorted(held[p]))
            hashes[p].update(repr(what).encode())
    return [h.hexdigest() for h in hashes]


def held_regions(items: Mapping[str, Any]) -> dict:
    """The marker's ``held``: the regions this process holds of each jax.Array leaf it
    does not hold whole, each distinct set once."""
    me = _distributed.process_index()
    sets: list[list] = []
    seen: dict[tuple, int] = {}
    out: dict[str, dict[str, int]] = {}
    for name, path, leaf in _array_leaves(items):
        shape = leaf.shape
        mine = {
            tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
            for d, index in leaf.sharding.devices_indices_map(shape).items()
            if d.process_index == me
        }  # the regions of a sharding are disjoint or equal: their sizes add up
        if sum(math.prod(b - a for a, b in r) for r in mine) == math.prod(shape):
            continue  # held whole
        key = tuple(sorted(mine))
        if key not in seen:
            seen[key] = len(sets)
            sets.append([[list(d) for d in r] for r in key])
        out.setdefault(name, {})[path] = seen[key]
    return {"sets": sets, "items": out}


def own_marker(step: int, run: str | None, items: Mapping[str, Any]) -> bytes:
    """This host's :data:`HOST_FILE` for ``step`` saved from ``items`` (its own shards)."""
    layout, hosts = layout_digest(items), host_regions(items)
    return host_marker(step, run, layout, hosts, held_regions(items))


def host_marker(
    step: int, run: str | None, layout: str, hosts: list | None = None, held: dict | None = None
) -> bytes:
    """The bytes of this host's :data:`HOST_FILE` for ``step``; ``hosts`` and ``held``:
    :func:`host_regions` and :func:`held_regions` (None: a copy of every region)."""
    doc = {
        "held": held,
        "format": _FORMAT,
        "step": step,
        "run": run,
        "process_index": _distributed.process_index(),
        "process_count": _distributed.process_count(),
        "devices": device_map(),
        "layout": layout,
        "hosts": hosts,
    }
    return _local_files.encode(
        doc, HOST_FILE, _local_files.HOST_MARKER, sort_keys=True, separators=None
    )


def read_marker(loc: Location, step: int) -> tuple[dict | None, str | None]:
    """``(doc, None)``: this host's checked :data:`HOST_FILE` of ``step``; else ``(None, why)``."""
    return _host_copy.read_at(_steps.step_location(loc, step))


def _marker_problem(loc: Location, step: int, run: Any) -> str | None:
    """What differs from this process of this run (None: any run) with today's
    process->device map in the marker of ``step``; None when nothing."""
    doc, problem = read_marker(loc, step)
    if doc is None:
        return problem
    want = {
        "format": _FORMAT,
        "step": step,
        "run": doc.get("run") if run is None else run,
        "process_index": _distributed.process_index(),
        "process_count": _distributed.process_count(),
        "devices": device_map(),
    }
    bad = [k for k, v in want.items() if doc.get(k) != v]
    return f"{HOST_FILE} differs in {', '.join(bad)}" if bad else None


def valid_steps(loc: Location, steps: list[int], run: Any, *, quiet: bool = False) -> list[int]:
    """The ``steps`` whose marker matches (:func:`_marker_problem`); others logged."""
    out = []
    for s in steps:
        problem = _marker_problem(loc, s, run)
        if problem is None:
            out.append(s)
        elif not quiet:
            logger.info("checkpoint: local step %d of %s is not this host's: %s", s, loc, problem)
    return out


def agreed_time(region: _distributed.Region | None) -> float:
    """Collective (in the save's ``region``): the primary's clock on every process, the
    ``created_at`` of a per-host step (every host writes the same bytes)."""
    op = _distributed.next_operation_id("per-host-time", region=region)
    return float(_distributed.broadcast_str(op, repr(time.time()), region=region))


def detect(
    loc: Location,
    persistent: Any,
    incremental: bool,
    format_version: int | None,
    region: _distributed.Region | None,
) -> bool:
    """Collective, at a writer's open (in its ``region``): whether each process has its
    own directory (only with a persistent tier). Creates this process's directory."""
    if persistent is None or not loc.is_local or _distributed.process_count() == 1:
        return False
    loc.makedirs()
    own = _shared_dir.check_visible(loc, region, per_host_ok=True)
    if own and incremental:
        raise CheckpointError(
            f"{loc}: incremental=True is not supported with a directory per host (each "
            f"process sees its own {loc.path}); use a shared directory or incremental=False"
        )
    if (
        own
        and format_version is not None
        and not _formats.for_version(format_version).per_host_directories
    ):
        raise CheckpointError(
            f"{loc}: format_version={format_version} is not supported yet with a directory "
            f"per host (each process sees its own {loc.path}); use format_version=1 or a "
            f"shared directory"
        )
    if own:
        logger.info("checkpoint: %s is this host's own directory (one per host)", loc)
    return own


def open_tier(
    loc: Location, tier: Any, own: bool, region: _distributed.Region | None
) -> str | None:
    """Collective (in the manager open's ``region``): opens ``tier`` with the local steps
    of ``loc`` (``own``: those every host holds of this run); returns the run owning the
    places (None unless ``own``), every host's directory claimed for it, or raises alike."""
    local_steps = _steps.committed_steps(loc)
    if own:
        mine = _open_view(loc, local_steps)
        views = _distributed.gather_json("per-host-open", mine, region=region)
        local_steps = _queued(views)
    tier.open(local_steps, region=region)
    if not own:
        return None
    op = _distributed.next_operation_id("per-host-run", region=region)
    run = json.loads(_distributed.broadcast_str(op, json.dumps(tier.run_id), region=region))
    error = None
    if not _distributed.is_primary():  # the primary's: its run owner checked it
        try:
            claim_directory(loc, run, _steps.committed_steps(loc))
        except CheckpointError as e:
            error = e
    _distributed.agree("per-host-claim", error, region=region, what=f"the open of {loc}")
    # A full copy from the bucket holds every region: readable with any layout.
    tier.mark_copies(lambda step: host_marker(step, run, COPY_LAYOUT))
    return run


def _open_view(loc: Location, steps: list[int]) -> dict:
    """This host's part of the open: the run of each valid step, and the primary's record's."""
    record = None
    if _distributed.is_primary():
        try:
            found = _lease.read_record(loc)
        except CheckpointError:
            found = None
        record = None if found is None else found.run
    runs = {}
    for step in valid_steps(loc, steps, None, quiet=True):
        doc, _ = read_marker(loc, step)
        runs[str(step)] = None if doc is None else doc["run"]
    return {"record": record, "runs": runs}


def _queued(views: list[dict]) -> list[int]:
    """The local steps every host holds, each copy's marker naming the primary's run."""
    run = views[0]["record"]
    if run is None:
        return []
    return sorted(int(s) for s in views[0]["runs"] if all(v["runs"].get(s) == run for v in views))


def claim_directory(loc: Location, run: str, steps: list[int]) -> None:
    """A non-primary host's own directory taken for ``run`` (``docs/run_owner.md``): its
    run record must name ``run``; without one, every committed step's marker must, and
    the record is written. CheckpointError otherwise, nothing touched."""
    record = _lease.read_record(loc)  # CorruptCheckpointError when malformed
    if record is not None:
        if record.run != run:
            raise CheckpointError(
                f"{loc} belongs to run {record.run} but this run is {run} (its "
                f"{_lease.RUN_FILE} differs from the primary's places): this host's "
                f"directory holds another run's steps, and mixing them would restore or "
                f"delete the other's. Give this host a directory of its own for this run"
            )
        return
    foreign = [s for s in steps if (read_marker(loc, s)[0] or {}).get("run") != run]
    if foreign:
        raise CheckpointError(
            f"{loc} holds steps {foreign[-3:]} but no run record "
            f"({_lease.RUN_FILE}), and their {HOST_FILE} do not name this run {run}: "
            f"they are another run's, and mixing them would restore or delete the other's. "
            f"Give this host a directory of its own for this run"
        )
    mine = _lease.RunRecord.here(run, secrets.token_hex(8))
    loc.write_bytes(_lease.RUN_FILE, mine.to_bytes())


def remove_steps(
    loc: Location, steps: list[int], committed: list[int], region: _distributed.Region | None
) -> None:
    """Collective (in ``region``): ``CheckpointManager.delete`` over each host's own
    directory. Which host holds which step is agreed first; a step no host holds is a
    CheckpointNotFoundError everywhere (nothing removed); else each removes its own."""
    mine = [s for s in steps if s in committed]
    held = _distributed.gather_json("per-host-delete", mine, region=region)
    missing = [s for s in steps if not any(s in view for view in held)]
    if missing:
        hosts = "; ".join(f"process {p}: {sorted(v)}" for p, v in enumerate(held))
        raise CheckpointNotFoundError(
            f"{', '.join(map(str, missing))}: no committed step of any host's own "
            f"directory ({loc} here; of {steps}, each holds {hosts}); nothing was removed"
        )
    for step in steps:
        if step in committed:
            _removing.remove_step(loc, step)


def with_primary_extras(
    items: dict[str, Any], region: _distributed.Region | None
) -> dict[str, Any]:
    """``items`` with the primary's ``extras`` item (none where it has none), on every
    process (collective, one broadcast in the save's ``region``): the step's one
    manifest records one checksum per file, so every host's copy holds the same JSON."""
    extras = items.get("extras")
    op = _distributed.next_operation_id("per-host-extras", region=region)
    text = json.dumps(None if extras is None else to_json(extras, "extras"))
    mine = text if _distributed.is_primary() else None
    agreed = json.loads(_distributed.broadcast_str(op, mine, region=region))
    out = {n: v for n, v in items.items() if n != "extras"}
    return out if agreed is None else {**out, "extras": from_json(agreed)}
