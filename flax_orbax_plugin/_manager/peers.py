"""Way (b) of a per-host restore: a process that lost its copy of a step gets it from a
peer over jax collectives.

``fetch`` is collective: every process calls it, in the same order.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.peers``.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from .._base import distributed as _distributed
from .._core import ownership as _ownership
from .._core.save import Staging
from .._errors import CheckpointError, CorruptCheckpointError
from .._format import steps as _steps
from .._format.layout import MANIFEST_FILE
from .._storage.location import Location
from . import per_host as _per_host
from .tiers import files as _files

logger = logging.getLogger("flax_orbax_plugin")

PIECE_BYTES = 32 << 20  # bytes per collective broadcast


def _offer(doc: dict | None) -> dict | None:
    if doc is None:
        return None
    return {"full": doc.get("layout") == _per_host.COPY_LAYOUT, "hosts": doc.get("hosts")}


def plan(offers: list[dict | None]) -> dict[int, int] | str:
    """``{recipient: donor}`` for every process without the step, or why not (the same
    on every process: a function of the gathered offers)."""
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


def fetch(
    loc: Location, step: int, run: Any, holds: bool, region: _distributed.Region | None
) -> bool:
    """Collective (in ``region``): way (b) for ``step`` (``holds``: this process has a
    valid copy). True on every process when all now hold it committed, else False."""
    doc = _per_host.read_marker(loc, step)[0] if holds else None
    offers = _distributed.gather_json("peer-offer", _offer(doc), region=region)
    chosen = plan(offers)
    if isinstance(chosen, str):
        logger.info("checkpoint: step %d cannot come from the peers, no way b: %s", step, chosen)
        return False
    me, t0, errors = _distributed.process_index(), time.perf_counter(), []
    for donor in sorted(set(chosen.values())):
        takers = sorted(r for r, d in chosen.items() if d == donor)
        given = doc if me == donor else None
        error = _from_donor(loc, step, run, donor, me in takers, given, region)
        errors.append(error)
    error = next((e for e in errors if e is not None), None)
    views = _distributed.gather_json("peer-commit", error, region=region)
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
    region: _distributed.Region | None,
) -> str | None:
    """Collective: ``donor``'s copy of ``step`` sent to every process; committed here
    when ``take``. Returns this process's error (None: none)."""
    mine = None
    if doc is not None:  # this process is the donor
        try:
            mine = _read_copy(loc, step)
        except (CheckpointError, OSError) as e:
            mine = f"{type(e).__name__}: {e}"
    listing = None
    if doc is not None:
        listing = (
            {"error": mine}
            if isinstance(mine, str)
            else {
                "files": [[rel, len(data), hashlib.sha256(data).hexdigest()] for rel, data in mine],
                "layout": doc.get("layout"),
                "hosts": doc.get("hosts"),
                "held": doc.get("held"),  # the donor's regions are the recipient's
            }
        )
    listing = _distributed.gather_json("peer-listing", listing, region=region)[donor]
    if "error" in listing:
        return f"process {donor} could not read its copy: {listing['error']}" if take else None
    total = sum(size for _, size, _ in listing["files"])
    blob = b"".join(data for _, data in mine) if doc is not None else b""
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
    names = [n for n in _files.local_files(root, step) if n != _per_host.HOST_FILE]
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
        marker = _per_host.host_marker(
            step, run, listing["layout"], listing["hosts"], listing.get("held")
        )
        staging.location.write_bytes(_per_host.HOST_FILE, marker, durable=False)
        staging.location.sync()
        staging.publish(MANIFEST_FILE, raw, replace=False)
    except BaseException:
        staging.abort()
        raise
