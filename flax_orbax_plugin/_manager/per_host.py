"""Each host's own local directory: saving, the persistent tier and restore ways (way b:
a step from a peer over jax collectives) of a manager whose processes see no shared one.
Collective where they say so: every process calls them in one order, on the training thread.

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
import numpy as np
from jax.experimental import multihost_utils

from .._base import distributed as _distributed
from .._base import tree as _tree
from .._core import formats as _formats
from .._core import ownership as _ownership
from .._core import removing as _removing
from .._core.save import Staging
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .._format import steps as _steps
from .._format.layout import HOST_FILE, MANIFEST_FILE
from .._storage import lease as _lease
from .._storage import local_files as _local_files
from .._storage import shared_dir as _shared_dir
from .._storage.location import Location
from .checkpointables import from_json, to_json
from .tiers import files as _files

logger = logging.getLogger("flax_orbax_plugin")

_FORMAT = _steps.MARKER_FORMAT
COPY_LAYOUT = _steps.COPY_LAYOUT  # the marker's layout of a bucket's step


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


def own_marker(step: int, run: str | None, items: Mapping[str, Any]) -> bytes:
    """This host's :data:`HOST_FILE` for ``step`` saved from ``items`` (its own shards):
    ``layout``, a sha256 over every jax.Array leaf's path, shape, dtype and device ->
    region map (informational); ``hosts``, per process index a sha256 over the regions its
    devices hold (no device ids: two processes with one digest can read each other's
    copy); ``held``, the regions this process holds of each leaf it does not hold whole,
    each distinct set once."""
    count, me = _distributed.process_count(), _distributed.process_index()
    layout, hosts = hashlib.sha256(), [hashlib.sha256() for _ in range(count)]
    sets: list[list] = []
    seen: dict[tuple, int] = {}
    held: dict[str, dict[str, int]] = {}
    for name, path, leaf in _array_leaves(items):
        shape, dtype = leaf.shape, str(leaf.dtype)
        index_map = leaf.sharding.devices_indices_map(shape).items()
        regions = sorted((d.id, tuple((s.start, s.stop) for s in index)) for d, index in index_map)
        layout.update(repr((name, path, shape, dtype, regions)).encode())
        per_process: list[set] = [set() for _ in range(count)]
        for d, index in index_map:
            per_process[d.process_index].add(tuple((s.start, s.stop) for s in index))
        for p in range(count):
            hosts[p].update(repr((name, path, shape, dtype, sorted(per_process[p]))).encode())
        mine = {
            tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
            for d, index in index_map
            if d.process_index == me
        }  # the regions of a sharding are disjoint or equal: their sizes add up
        if sum(math.prod(b - a for a, b in r) for r in mine) == math.prod(shape):
            continue  # held whole
        key = tuple(sorted(mine))
        if key not in seen:
            seen[key] = len(sets)
            sets.append([[list(d) for d in r] for r in key])
        held.setdefault(name, {})[path] = seen[key]
    digests = [h.hexdigest() for h in hosts]
    return host_marker(step, run, layout.hexdigest(), digests, {"sets": sets, "items": held})


def host_marker(
    step: int, run: str | None, layout: str, hosts: list | None = None, held: dict | None = None
) -> bytes:
    """The bytes of this host's :data:`HOST_FILE` (``hosts`` None: a copy of every region)."""
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
    return _steps.read_at(_steps.step_location(loc, step))


def _marker_problem(loc: Location, step: int, run: Any) -> str | None:
    """What differs in ``step``'s marker from this process of ``run`` (None: any run)."""
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


def agreed_time(region: _distributed.Region) -> float:
    """Collective (in ``region``): the primary's clock, a per-host step's ``created_at``."""
    return float(region.broadcast_str(region.next_operation_id("per-host-time"), repr(time.time())))


def detect(
    loc: Location,
    persistent: Any,
    incremental: bool,
    format_version: int | None,
    region: _distributed.Region,
) -> bool:
    """Collective, at a writer's open: whether each process has its own directory."""
    if persistent is None or not loc.is_local or _distributed.process_count() == 1:
        return False
    loc.makedirs()
    own = _shared_dir.check_visible(loc, region, per_host_ok=True)
    if own and incremental:
        raise CheckpointError(
            f"{loc}: incremental=True is not supported with a directory per host (each "
            f"process sees its own {loc.path}); use a shared directory or incremental=False"
        )
    version = None if format_version is None else _formats.for_version(format_version)
    if own and version is not None and not version.per_host_directories:
        raise CheckpointError(
            f"{loc}: format_version={format_version} is not supported yet with a directory "
            f"per host (each process sees its own {loc.path}); use format_version=1 or a "
            f"shared directory"
        )
    if own:
        logger.info("checkpoint: %s is this host's own directory (one per host)", loc)
    return own


def open_tier(loc: Location, tier: Any, own: bool, region: _distributed.Region) -> str | None:
    """Collective (in ``region``): opens ``tier`` with the local steps of ``loc``; returns
    the run owning the places (None unless ``own``), every host's directory claimed for it."""
    local_steps = _steps.committed_steps(loc)
    if own:
        mine = _open_view(loc, local_steps)
        views = region.gather_json("per-host-open", mine)
        primary = views[0]["record"]  # the steps every host holds, each of the primary's run
        held = (s for s in views[0]["runs"] if all(v["runs"].get(s) == primary for v in views))
        local_steps = [] if primary is None else sorted(int(s) for s in held)
    tier.open(local_steps, region=region)
    if not own:
        return None
    op = region.next_operation_id("per-host-run")
    run = json.loads(region.broadcast_str(op, json.dumps(tier.run_id)))
    error = None
    if not _distributed.is_primary():  # the primary's: its run owner checked it
        try:
            claim_directory(loc, run, _steps.committed_steps(loc))
        except CheckpointError as e:
            error = e
    region.agree("per-host-claim", error, what=f"the open of {loc}")
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


def claim_directory(loc: Location, run: str, steps: list[int]) -> None:
    """A non-primary host's own directory taken for ``run`` (``docs/run_owner.md``): its
    run record, else every step's marker, must name ``run`` (then the record is written)."""
    record = _lease.read_record(loc)  # CorruptCheckpointError when malformed
    if record is not None:
        if record.run != run:
            raise CheckpointError(
                f"{loc} belongs to run {record.run} but this run is {run} (its "
                f"{_lease.RUN_FILE}): mixing runs would restore or delete the other's "
                "steps. Give this host a directory of its own for this run"
            )
        return
    foreign = [s for s in steps if (read_marker(loc, s)[0] or {}).get("run") != run]
    if foreign:
        raise CheckpointError(
            f"{loc} holds steps {foreign[-3:]} but no run record ({_lease.RUN_FILE}), "
            f"and their {HOST_FILE} do not name this run {run}: they are another run's (mixing "
            f"would restore or delete them). Give this host a directory of its own for this run"
        )
    mine = _lease.RunRecord.here(run, secrets.token_hex(8))
    loc.write_bytes(_lease.RUN_FILE, mine.to_bytes())


def remove_steps(
    loc: Location, steps: list[int], committed: list[int], region: _distributed.Region
) -> None:
    """Collective (in ``region``): ``CheckpointManager.delete`` over each host's own
    directory; a step no host holds is refused everywhere, else each removes its own."""
    mine = [s for s in steps if s in committed]
    held = region.gather_json("per-host-delete", mine)
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


def with_primary_extras(items: dict[str, Any], region: _distributed.Region) -> dict[str, Any]:
    """``items`` with the primary's ``extras`` item (collective, in ``region``): the one
    manifest records one checksum per file, so every host's copy holds the same JSON."""
    extras = items.get("extras")
    op = region.next_operation_id("per-host-extras")
    text = json.dumps(None if extras is None else to_json(extras, "extras"))
    mine = text if _distributed.is_primary() else None
    agreed = json.loads(region.broadcast_str(op, mine))
    out = {n: v for n, v in items.items() if n != "extras"}
    return out if agreed is None else {**out, "extras": from_json(agreed)}


PIECE_BYTES = 32 << 20  # bytes per collective broadcast


def _offer(doc: dict | None) -> dict | None:
    if doc is None:
        return None
    return {"full": doc.get("layout") == COPY_LAYOUT, "hosts": doc.get("hosts")}


def peer_plan(offers: list[dict | None]) -> dict[int, int] | str:
    """``{recipient: donor}`` for every process without the step, or why not."""
    holders = [p for p, o in enumerate(offers) if o is not None]
    recipients = [p for p, o in enumerate(offers) if o is None]
    if not holders:
        return "no process holds it"
    out = {}
    for r in recipients:
        for h in holders:
            hosts = offers[h].get("hosts")
            same = isinstance(hosts, list) and len(hosts) == len(offers) and hosts[r] == hosts[h]
            if offers[h].get("full") or same:
                out[r] = h
                break
        else:
            return (
                f"no process holding it holds the regions process {r} needs (a state "
                f"sharded with no replica across hosts, or one saved with another layout)"
            )
    return out


def fetch_from_peers(
    loc: Location, step: int, run: Any, holds: bool, region: _distributed.Region
) -> bool:
    """Collective (in ``region``): way (b) for ``step``; True when all now hold it committed."""
    doc = read_marker(loc, step)[0] if holds else None
    offers = region.gather_json("peer-offer", _offer(doc))
    chosen = peer_plan(offers)
    if isinstance(chosen, str):
        logger.info("checkpoint: step %d cannot come from the peers, no way b: %s", step, chosen)
        return False
    me, t0, errors = _distributed.process_index(), time.perf_counter(), []
    for donor in sorted(set(chosen.values())):
        take, given = chosen.get(me) == donor, (doc if me == donor else None)
        errors.append(_from_donor(loc, step, run, donor, take, given, region))
    error = next((e for e in errors if e is not None), None)
    views = region.gather_json("peer-commit", error)
    bad = [f"process {p}: {v}" for p, v in enumerate(views) if v is not None]
    if bad:
        logger.warning(
            "checkpoint: step %d from the peers failed, no way b: %s", step, "; ".join(bad)
        )
        return False
    logger.info(
        "checkpoint: step %d sent by peers over jax collectives: %s, %.3f s",
        step,
        ", ".join(f"process {d} -> process {r}" for r, d in sorted(chosen.items())),
        time.perf_counter() - t0,
    )
    return True


def _from_donor(
    loc: Location,
    step: int,
    run: Any,
    donor: int,
    take: bool,
    doc: dict | None,
    region: _distributed.Region,
) -> str | None:
    """Collective: ``donor``'s copy of ``step`` sent, committed here when ``take``; an error."""
    mine, listing = [], None
    if doc is not None:  # this process is the donor
        try:
            mine = _read_copy(loc, step)
        except (CheckpointError, OSError) as e:
            listing = {"error": f"{type(e).__name__}: {e}"}
        else:
            listing = {
                "files": [[rel, len(data), hashlib.sha256(data).hexdigest()] for rel, data in mine],
                "layout": doc.get("layout"),
                "hosts": doc.get("hosts"),
                "held": doc.get("held"),  # the donor's regions are the recipient's
            }
    listing = region.gather_json("peer-listing", listing)[donor]
    if "error" in listing:
        return f"process {donor} could not read its copy: {listing['error']}" if take else None
    total = sum(size for _, size, _ in listing["files"])
    blob = b"".join(data for _, data in mine)
    received = _broadcast(blob, total, doc is not None)
    if not take:
        return None
    try:
        _commit(loc, step, run, listing, received)
    except (CheckpointError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _read_copy(loc: Location, step: int) -> list[tuple[str, bytes]]:
    """Every file of this host's copy of ``step`` but its marker, the manifest last."""
    root = _steps.step_location(loc, step).path
    names = [n for n in _files.local_files(root, step) if n != HOST_FILE]
    return [(n, _files.read_local_file(root, n, step)) for n in [*names, MANIFEST_FILE]]


def _broadcast(blob: bytes, total: int, source: bool) -> bytes:
    """Collective: the source's ``total`` bytes ``blob`` on every process."""
    piece = min(PIECE_BYTES, max(1 << 12, 1 << max(total - 1, 1).bit_length()))
    out = bytearray()
    for start in range(0, total, piece):
        buf = np.zeros(piece, np.uint8)
        if source:
            part = blob[start : start + piece]
            buf[: len(part)] = np.frombuffer(part, np.uint8)
        got = multihost_utils.broadcast_one_to_all(buf, is_source=source)
        out += np.asarray(got)[: min(piece, total - start)].tobytes()
    return bytes(out)


def _commit(loc: Location, step: int, run: Any, listing: dict, received: bytes) -> None:
    """The received copy checked, staged with this host's marker and committed."""
    final = _steps.step_location(loc, step)
    where = f"the peer's copy of step {step}"
    files, offset = {}, 0
    for rel, size, sha in listing["files"]:
        data = received[offset : offset + size]
        offset += size
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise CorruptCheckpointError(f"{where}: {rel}: not received intact (size, sha256)")
        files[rel] = data
    raw = files.pop(MANIFEST_FILE)
    manifest = _files.parse_manifest(raw, final, step)
    for rel, want in manifest.files.items():
        if rel in files and hashlib.sha256(files[rel]).hexdigest() != want:
            raise CorruptCheckpointError(f"{where}: {rel}: sha256 differs from {MANIFEST_FILE}")
    if _ownership.check_slot(final, what=f"step {step}", replace=False):
        _ownership.remove(final, action="clear the remains of a dead copy at")
    staging = Staging.begin(final, secrets.token_hex(6), own=True)
    try:
        for rel, data in files.items():
            staging.location.write_bytes(rel, data, durable=False)
        marker = host_marker(step, run, listing["layout"], listing["hosts"], listing.get("held"))
        staging.location.write_bytes(HOST_FILE, marker, durable=False)
        staging.location.sync()
        staging.publish(MANIFEST_FILE, raw, replace=False)
    except BaseException:
        staging.abort()
        raise
