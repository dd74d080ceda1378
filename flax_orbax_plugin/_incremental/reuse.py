"""Incremental steps: a leaf unchanged since the previous committed step is reused
(hard-linked locally, :mod:`.links`; copied on the server on S3 and GCS, :mod:`.copies`;
whole data files in version 2, :mod:`.packed`). Here: the way per store, the digests,
the previous step and the plan. All on the save's background thread, on every process,
only with :class:`Reuse` given. Design notes: ``docs/incremental.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import xxhash

from .._base import distributed as _distributed
from .._base import shown as _shown
from .._errors import CheckpointError
from .._format import layout as _layout
from .._format.layout import ArrayStorage, BatchStorage, CheckpointDocument, LeafRecord
from .._storage import server_copy as _server_copy
from .._storage.location import Location
from .._zarr import chunks as _chunks

logger = logging.getLogger("flax_orbax_plugin")

DIGEST_ALGORITHM = "xxh3_128r"  # a hash over (region bounds, xxh3_128 of its bytes)


@dataclasses.dataclass(frozen=True)
class Reuse:
    """Incremental save of one pytree item: record leaf digests and reuse the unchanged
    leaves of ``item`` in ``previous_step`` (None for the first step: digests only).

    ``op``: the key-value name of the region hash exchange, drawn on the training thread
    in the same order on every process; None with several processes: nothing reused."""

    previous_step: Location | None
    item: str
    op: str | None = None


_LOGGED: set[tuple[str, str]] = set()
_LOGGED_LOCK = threading.Lock()


def reuser(
    location: Location, *, link: Callable[..., Any], copy: Callable[..., Any]
) -> Callable[..., int | None] | None:
    """How this process reuses unchanged data under ``location``: ``link`` locally, ``copy``
    with the store's server-side copier; None where there is none (logged once)."""
    if location.is_local:
        return link
    copier, why = _server_copy.copier_for(location)
    if copier is None:
        store = str(location.parent.parent)  # the manager directory, not the step
        with _LOGGED_LOCK:
            first = (store, why) not in _LOGGED
            _LOGGED.add((store, why))
        if first:
            logger.warning(
                "incremental save: every leaf is written under %s (no reuse): %s", store, why
            )
        return None
    return functools.partial(copy, copier)


# -- 1. digests ---------------------------------------------------------------------------

Bounds = tuple[tuple[int, int], ...]  # (start, stop) per axis, in the leaf's coordinates
Entry = tuple[Bounds, str]  # a region and the xxh3_128 hex of its bytes


def region_hash(data: np.ndarray) -> str:
    """``xxh3_128`` hex of ``data``'s elements in C order as little-endian bytes."""
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return xxhash.xxh3_128(np.ascontiguousarray(data).reshape(-1).view(np.uint8)).hexdigest()


def region_digests(
    record: LeafRecord, writes: Iterable[tuple[tuple[slice, ...], np.ndarray]]
) -> list[Entry]:
    """This process's ``(bounds, hash)`` of every region of one leaf it writes."""
    shape = tuple(record.shape)
    out = []
    for region, data in writes:
        bounds = tuple(s.indices(n)[:2] for s, n in zip(region, shape, strict=True))
        if tuple(data.shape) != tuple(b - a for a, b in bounds):
            raise ValueError(f"leaf {record.path!r}: region {bounds} holds shape {data.shape}")
        out.append((bounds, region_hash(data)))
    return out


def leaf_digest(entries: Iterable[Entry]) -> str:
    """``"xxh3_128r:<hex>"``: XXH3-128 of the sorted lines ``start:stop,...=<hash>\n``
    of every process's ``entries`` (FORMAT.md)."""
    lines = sorted((tuple(tuple(map(int, ab)) for ab in b), h) for b, h in entries)
    hasher = xxhash.xxh3_128()
    for bounds, h in lines:
        hasher.update((",".join(f"{a}:{b}" for a, b in bounds) + f"={h}\n").encode())
    return f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}"


def exchange(
    op: str | None, mine: dict[int, list[Entry]] | None, region: _distributed.Region
) -> dict[int, list[Entry]] | None:
    """Every process's entries, merged per leaf index (``mine`` as is with one process);
    None when any process could not hash (or ``op`` is None). Background thread, same
    call order on every process, in ``region``; :func:`release` deletes the value."""
    if _distributed.process_count() == 1:
        return mine
    if op is None:
        return None
    text = "null"
    if mine is not None:
        text = json.dumps(
            {str(i): [[[list(ab) for ab in b], h] for b, h in e] for i, e in mine.items()},
            separators=(",", ":"),
        )
    region.publish(f"{op}/regions", text)
    merged: dict[int, list[Entry]] = {}
    failed = False
    for value in region.gather_str(f"{op}/regions"):  # each read, always
        got = json.loads(value)
        if got is None:
            failed = True
            continue
        for i, entries in got.items():
            merged.setdefault(int(i), []).extend(
                (tuple((int(a), int(b)) for a, b in bounds), str(h)) for bounds, h in entries
            )
    return None if failed else merged


def release(reuses: Iterable[Reuse]) -> None:
    """Deletes this process's exchanged values after the step's commit."""
    if _distributed.process_count() == 1:
        return
    for reuse in reuses:
        if reuse.op is not None:
            _distributed.Region.forget(f"{reuse.op}/regions")


# -- 2./3. the previous step and what to reuse ---------------------------------------------


def previous_document(reuse: Reuse) -> tuple[Location, CheckpointDocument] | None:
    """The previous step's item location and checked metadata, or None (logged)."""
    if reuse.previous_step is None:
        return None
    try:
        manifest = _layout.read_manifest(reuse.previous_step)
        entry = manifest.items.get(reuse.item)
        if entry is None or entry.kind != "pytree":
            return None
        location = reuse.previous_step.child(entry.dir)
        listed = _layout.item_checksums(manifest, entry.dir)  # the manifest just read
        doc = _layout.read_listed_document(location, listed)
    except (CheckpointError, OSError) as e:
        logger.warning("incremental save: not reusing %s: %s", reuse.previous_step, e)
        return None
    return location, doc


def plan_reuse(records: dict[int, LeafRecord], previous: CheckpointDocument) -> dict[int, int]:
    """``{leaf index: previous index}`` of array leaves matching in every field of their bytes."""
    by_path = {r.path: (j, r) for j, r in enumerate(previous.leaves)}
    out = {}
    for i, rec in records.items():
        j, old = by_path.get(rec.path, (None, None))
        if (
            old is not None
            and rec.digest is not None
            and isinstance(rec.storage, ArrayStorage)
            and isinstance(old.storage, ArrayStorage)
            and old.digest == rec.digest
            and old.kind == rec.kind
            and tuple(old.shape) == tuple(rec.shape)
            and old.dtype == rec.dtype
            and tuple(old.storage.chunk_shape) == tuple(rec.storage.chunk_shape)
            and old.storage.codec == rec.storage.codec
            and old.storage.codec is None  # compressed chunks have no fixed size to check
            and old.storage.packed == rec.storage.packed  # (a sub-byte leaf's layout)
            and old.impl == rec.impl
        ):
            out[i] = j
    return out


def report_batched(store: Location, item: str, records: Iterable[LeafRecord]) -> None:
    """Warns (once per store and item) which leaves of ``item`` are batched and so written
    again at every incremental step: reuse takes only leaves stored as their own arrays."""
    batched = [r for r in records if isinstance(r.storage, BatchStorage)]
    if not batched:
        return
    key = (str(store), f"batched:{item}")
    with _LOGGED_LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    nbytes = sum(r.nbytes for r in batched)
    logger.warning(
        "incremental steps: %d small leaves of item %r (%s in all; 1 MiB or less each, "
        "batched together) are never reused: they are written again at every step, "
        "changed or not; only leaves stored as their own arrays (over 1 MiB, or "
        "partitioned) are reused. The leaves: %s",
        len(batched),
        item,
        _size(nbytes),
        _shown.listed((r.path for r in batched), fmt=repr),
    )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


# -- 4. the chunks a process reuses -----------------------------------------------------


def chunks_of(record: LeafRecord, regions: Iterable[Bounds]) -> list[tuple[str, ...]] | None:
    """The chunk files ``regions`` cover, sorted; None when a region is not on chunk
    boundaries (its chunks are shared: written, never reused)."""
    chunk, shape = record.storage.chunk_shape, tuple(record.shape)
    out: set[tuple[str, ...]] = set()
    for bounds in regions:
        ranges = []
        for (a, b), c, n in zip(bounds, chunk, shape, strict=True):
            if a % c or (b % c and b != n):
                return None
            ranges.append(range(a // c, -(-b // c)))
        out.update(_chunks.chunk_parts(idx) for idx in itertools.product(*ranges))
    return sorted(out)


# -- 4. what a snapshot reuses -----------------------------------------------------------


def unchanged(leaves: list, fmt: Any, location: Location, reuse: Reuse, region: Any):
    """Records the digest of every array leaf (collective in ``region``: every process,
    same order) and returns (the way to reuse, the previous item, [(leaf, previous
    index, this process's chunks)] of the unchanged leaves), or None (nothing reused)."""
    way = fmt.reuser(location)
    if way is None and _distributed.process_count() == 1:
        return None
    arrays = [leaf for leaf in leaves if isinstance(leaf.record.storage, ArrayStorage)]
    mine: dict[int, list] | None = None
    try:
        mine = {
            leaf.index: region_digests(leaf.record, leaf.writes) for leaf in arrays if leaf.writes
        }
    except Exception as e:  # noqa: BLE001  (no digest, no reuse; the save goes on)
        logger.warning("incremental save: no digests recorded: %s", e)
    everyone = exchange(reuse.op, mine, region)
    if everyone is None or mine is None:
        return None
    for leaf in arrays:
        if everyone.get(leaf.index):
            digest = leaf_digest(everyone[leaf.index])
            leaf.record = dataclasses.replace(leaf.record, digest=digest)
    previous = None if way is None else previous_document(reuse)
    if previous is None or not fmt.wrote(previous[1]):
        return None  # (a step of the other version: its chunks are stored elsewhere)
    source, doc = previous
    if _distributed.is_primary():  # what reuse never takes, said once (WARNING)
        records = [leaf.record for leaf in leaves]
        report_batched(location.parent.parent, reuse.item, records)
    by_index = {leaf.index: leaf for leaf in leaves}
    records = {i: leaf.record for i, leaf in by_index.items()}
    unchanged = []
    for i, j in plan_reuse(records, doc).items():
        leaf = by_index[i]
        chunks = chunks_of(leaf.record, [b for b, _ in mine.get(i, ())])
        if leaf.writes and chunks is not None:
            unchanged.append((leaf, j, chunks))
    return way, source, unchanged
