"""Incremental steps: a leaf unchanged since the previous committed step is reused.

Its chunks are hard-linked from that step on a local filesystem (:mod:`.links`) or
copied on the server on S3 and GCS (:mod:`.copies`); in format version 2, whole data
files holding mostly unchanged leaves (:mod:`.packed`); every step stays
self-contained. This module is the way per store (:func:`reuser`), the digests
(:func:`region_digests`, :func:`exchange`, :func:`leaf_digest`, :func:`release`), the
previous step (:func:`previous_document`) and the plan (:func:`plan_reuse`,
:func:`chunks_of`). All on the background thread of the save (``_core.save``), on
every process, only with :class:`Reuse` given (``CheckpointManager(incremental=True)``).
Who calls what, the checks and what is not protected: ``docs/incremental.md``.
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
from .copies import copy_leaf  # noqa: F401  (version 1's ways, named here for callers)
from .links import link_leaf  # noqa: F401

logger = logging.getLogger("flax_orbax_plugin")

DIGEST_ALGORITHM = "xxh3_128r"  # a hash over (region bounds, xxh3_128 of its bytes)


@dataclasses.dataclass(frozen=True)
class Reuse:
    """Opt-in incremental save of one pytree item of a manager step: record leaf digests
    and reuse the unchanged leaves of ``item`` in ``previous_step`` (the previous
    committed step's directory; None for the first step, whose digests are still
    recorded).

    ``op``: the key-value name under which the processes exchange their region hashes
    (:func:`exchange`), drawn with ``_distributed.next_operation_id`` on the training
    thread in the same order on every process; None with several processes: nothing
    is hashed, exchanged or reused (one process needs none)."""

    previous_step: Location | None
    item: str
    op: str | None = None


_LOGGED: set[tuple[str, str]] = set()
_LOGGED_LOCK = threading.Lock()


def reuser(
    location: Location, *, link: Callable[..., Any], copy: Callable[..., Any]
) -> Callable[..., int | None] | None:
    """How this process reuses its data of unchanged leaves under ``location``, in the
    ways its format gives: ``link`` on a local filesystem (version 1's
    :func:`link_leaf`, version 2's ``packed.link_file``), ``copy`` with the store's
    server-side copier on S3 and GCS (:func:`copy_leaf`, ``packed.copy_file``); None
    (it writes every leaf) where no copier is available (logged once per store and
    reason)."""
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


def region_bounds(region: tuple[slice, ...], shape: tuple[int, ...]) -> Bounds:
    """``region`` (slices, None meaning the whole axis) as ``((start, stop), ...)``."""
    return tuple(s.indices(n)[:2] for s, n in zip(region, shape, strict=True))


def region_hash(data: np.ndarray) -> str:
    """``xxh3_128`` hex of ``data``'s elements in C order as little-endian bytes (numpy's
    in-memory form; one byte per ``bool`` and 8-bit element)."""
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return xxhash.xxh3_128(np.ascontiguousarray(data).reshape(-1).view(np.uint8)).hexdigest()


def region_digests(
    record: LeafRecord, writes: Iterable[tuple[tuple[slice, ...], np.ndarray]]
) -> list[Entry]:
    """This process's entries for one leaf: ``(bounds, hash)`` of every region it writes
    (see :func:`leaf_digest`). Raises ValueError when a region's data does not have
    the region's shape (never for a snapshot of this library)."""
    shape = tuple(record.shape)
    out = []
    for region, data in writes:
        bounds = region_bounds(region, shape)
        if tuple(data.shape) != tuple(b - a for a, b in bounds):
            raise ValueError(f"leaf {record.path!r}: region {bounds} holds shape {data.shape}")
        out.append((bounds, region_hash(data)))
    return out


def leaf_digest(entries: Iterable[Entry]) -> str:
    """``"xxh3_128r:<hex>"``: XXH3-128 of one ASCII line per region,
    ``start:stop,start:stop,...=<hash>`` and a newline (axes in order, ``hash`` the
    region's :func:`region_hash`), the lines sorted by bounds; ``entries``: those of
    every process that writes the leaf. Equal digests: the same regions, the same
    bytes in each (FORMAT.md)."""
    lines = sorted((tuple(tuple(map(int, ab)) for ab in b), h) for b, h in entries)
    hasher = xxhash.xxh3_128()
    for bounds, h in lines:
        hasher.update((",".join(f"{a}:{b}" for a, b in bounds) + f"={h}\n").encode())
    return f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}"


def exchange(
    op: str | None, mine: dict[int, list[Entry]] | None, region: _distributed.Region | None
) -> dict[int, list[Entry]] | None:
    """Every process's entries, merged per leaf index; ``mine`` (None: this process
    could not hash) as is with one process. With several, one key-value set of this
    process's JSON under ``<op>/regions/<process>`` and one blocking get per process
    (the coordination timeout; a lost process raises :class:`CoordinationError`).
    None when any process sent ``null`` (or ``op`` is None): nobody gets a digest.

    Background thread, same call order on every process, in ``region`` (the manager
    save's, its request's); :func:`release` deletes the value once every process has
    read it."""
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
    _distributed.publish(f"{op}/regions", text, region=region)
    merged: dict[int, list[Entry]] = {}
    failed = False
    for value in _distributed.gather_str(f"{op}/regions", region=region):  # each read, always
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
    """Deletes this process's exchanged values (after the step's commit, when every
    process has read them); errors are ignored. A no-op with one process."""
    if _distributed.process_count() == 1:
        return
    for reuse in reuses:
        if reuse.op is not None:
            _distributed.forget(f"{reuse.op}/regions")


# -- 2./3. the previous step and what to reuse ---------------------------------------------


def previous_document(reuse: Reuse) -> tuple[Location, CheckpointDocument] | None:
    """The previous step's item location and checked metadata; None (logged) when there
    is none, it is not a pytree, or it does not read cleanly."""
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
    """``{leaf index: previous leaf index}`` for every leaf (stored as its own array, with
    a digest) whose previous record matches in every field that decides its bytes."""
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
    """Warns (WARNING, once per store and item, in this process) which leaves of
    ``item`` are batched (``BatchStorage``: leaves of 1 MiB or less, packed together
    into one array) and so written again at every incremental step, changed or not:
    reuse takes only leaves stored as their own arrays (a frozen embedding of 1 MiB
    beside a trained adapter is rewritten every step). Names the first leaves and the
    bytes in all. See docs/incremental.md."""
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
    """The chunk files (as :func:`chunk_names`) that ``regions`` cover, sorted; None when
    a region does not start and end on chunk boundaries (or the leaf's end): its
    chunks are shared with another region, so it is written, never reused."""
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
    """An incremental save's leaves against the previous step: records the digest of
    every array leaf of a snapshot's ``leaves`` (every process's region hashes, through
    the key-value store with several processes, in the save's ``region``: every process
    calls this, in the same order); returns (the way to reuse, the previous step's
    item, [(leaf, its previous number, the chunks of this process's regions)] for the
    leaves the previous step holds unchanged and of which this process writes regions),
    or None where this process reuses nothing (see :func:`reuser`). ``fmt``: the
    snapshot's format (it knows its way to reuse and the steps it wrote); ``location``:
    the item being written. Called by the save's write (``_core.plan``)."""
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
