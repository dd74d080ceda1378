"""Incremental steps: a leaf unchanged since the previous committed step is reused, its
chunk files (version 2: whole data files) hard-linked locally or copied on the server,
each checked before and after; any failure removes what was taken and the leaf is
written (never failing the save). All on the save's background thread, on every
process, only with :class:`Reuse` given. Design notes: ``docs/incremental.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import itertools
import json
import logging
import math
import os
import stat
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import xxhash

from .._base import distributed as _distributed
from .._base import shown as _shown
from .._errors import CheckpointError
from .._format import layout as _layout
from .._format.layout import (
    ArrayStorage,
    BatchStorage,
    CheckpointDocument,
    LeafRecord,
    array_dir,
    dtype_from_name,
)
from .._storage import server_copy as _server_copy
from .._storage.local_files import open_dirs as _open_dirs
from .._storage.location import Location
from .._zarr import chunks as _chunks
from .._zarr import packed_reader as _packed_reader

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
    """``link`` locally, ``copy`` with the store's server-side copier, else None (logged once)."""
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


def region_digests(
    record: LeafRecord, writes: Iterable[tuple[tuple[slice, ...], np.ndarray]]
) -> list[Entry]:
    """This process's ``(bounds, xxh3_128 hex of its little-endian bytes)`` per region."""
    shape = tuple(record.shape)
    out = []
    for region, data in writes:
        bounds = tuple(s.indices(n)[:2] for s, n in zip(region, shape, strict=True))
        if tuple(data.shape) != tuple(b - a for a, b in bounds):
            raise ValueError(f"leaf {record.path!r}: region {bounds} holds shape {data.shape}")
        if data.dtype.byteorder == ">":
            data = data.astype(data.dtype.newbyteorder("<"))
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        out.append((bounds, xxhash.xxh3_128(flat).hexdigest()))
    return out


def leaf_digest(entries: Iterable[Entry]) -> str:
    """``xxh3_128r:<hex>`` of every process's ``entries`` (FORMAT.md)."""
    lines = sorted((tuple(tuple(map(int, ab)) for ab in b), h) for b, h in entries)
    hasher = xxhash.xxh3_128()
    for bounds, h in lines:
        hasher.update((",".join(f"{a}:{b}" for a, b in bounds) + f"={h}\n").encode())
    return f"{DIGEST_ALGORITHM}:{hasher.hexdigest()}"


def exchange(
    op: str | None, mine: dict[int, list[Entry]] | None, region: _distributed.Region
) -> dict[int, list[Entry]] | None:
    """Every process's entries, merged per leaf index; None when any could not hash.
    Background thread, same call order on every process, in ``region``."""
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
    """``{leaf index: previous index}`` of uncompressed array leaves matching in every field."""
    by_path = {r.path: (j, r) for j, r in enumerate(previous.leaves)}
    fields = lambda r: (r.digest, r.kind, tuple(r.shape), r.dtype, r.storage, r.impl)
    out = {}
    for i, rec in records.items():
        j, old = by_path.get(rec.path, (None, None))
        if (
            old is not None
            and rec.digest is not None
            and isinstance(rec.storage, ArrayStorage)
            and rec.storage.codec is None
            and fields(old) == fields(rec)  # storage: chunk shape, codec, packing
        ):
            out[i] = j
    return out


def report_batched(store: Location, item: str, records: Iterable[LeafRecord]) -> None:
    """Warns (once per store and item) which leaves of ``item`` are batched: never reused."""
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


# -- 4. what a snapshot reuses: the chunks of each unchanged leaf ---------------------------


def chunks_of(record: LeafRecord, regions: Iterable[Bounds]) -> list[tuple[str, ...]] | None:
    """The chunk files ``regions`` cover, sorted; None if one is off chunk boundaries."""
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


def unchanged(leaves: list, fmt: Any, location: Location, reuse: Reuse, region: Any):
    """Records the digest of every array leaf (collective in ``region``) and returns (the
    way to reuse, the previous item, [(leaf, previous index, chunks)]), or None."""
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


# -- 4b. a reused leaf's chunk files: local links, server-side copies -------------------

CRC_BYTES = _chunks.CRC_BYTES
_READ_BLOCK = 8 << 20  # a linked file is read in blocks: a chunk may be large
Writes = list[tuple[tuple[slice, ...], np.ndarray]]  # a leaf's (region, data) to write


class Refused(Exception):
    """One linked file fails a check: the leaf is written instead."""


def chunk_names(record: LeafRecord) -> list[tuple[str, ...]]:
    """Every chunk file of an array leaf, as path parts under ``d/<i>/``."""
    chunk = record.storage.chunk_shape
    grid = [max(1, -(-s // c)) for s, c in zip(record.shape, chunk, strict=True)]
    return [_chunks.chunk_parts(idx) for idx in itertools.product(*(range(g) for g in grid))]


def chunk_file_bytes(record: LeafRecord) -> int:
    """Size of each stored chunk file (a full chunk, padded, plus crc32c)."""
    itemsize = dtype_from_name(record.dtype).itemsize
    return math.prod(record.storage.chunk_shape) * itemsize + CRC_BYTES


def not_the_snapshot(shown: str, stored: int, expected: int) -> str:
    return (
        f"{shown}: its crc32c {stored:08x} is not that of the snapshot's bytes for this "
        f"chunk ({expected:08x}): it holds other bytes than its leaf's recorded digest says"
    )


def snapshot_crcs(
    record: LeafRecord, writes: Writes, names: Iterable[tuple[str, ...]]
) -> dict[tuple[str, ...], int]:
    """``{chunk name: crc32c}`` each chunk of ``names`` would get if written from ``writes``."""
    shape, chunk = tuple(record.shape), tuple(record.storage.chunk_shape)
    wanted = set(names)
    out: dict[tuple[str, ...], int] = {}
    for region, data in writes:
        if not data.size:
            continue
        try:
            crcs = _chunks.chunk_crcs(shape, chunk, region, data)
        except (ValueError, TypeError) as e:  # a region this function cannot encode
            raise Refused(f"the snapshot's crc32c per chunk: {type(e).__name__}: {e}") from e
        for cell, crc in (crcs or {}).items():
            if _chunks.chunk_parts(cell) in wanted:
                out[_chunks.chunk_parts(cell)] = crc
    missing = sorted(wanted - set(out))
    if missing:
        raise Refused(
            f"chunk {'/'.join(missing[0])}: not whole in this process's snapshot of the leaf"
            " (nothing to compare the previous chunk with)"
        )
    return out


def check_linked(dfd: int, name: str, shown: str, size: int, segments: list, differs) -> None:
    """Checks the file just linked as ``name`` in ``dfd`` (its inode can no longer be
    swapped): ``size`` bytes, each ``(where, offset, length, crc)`` segment's trailer
    matching its bytes and ``crc`` (else :class:`Refused` in ``differs``' words)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise Refused(f"{shown}: expected a regular file of {size} bytes, found {st.st_size}")
        for where, offset, length, expected in segments:
            crc, at, stop = 0, offset, offset + length
            while at < stop:
                block = os.pread(fd, min(_READ_BLOCK, stop - at), at)
                if not block:
                    break
                crc = _chunks.extend_crc(crc, block)
                at += len(block)
            if at != stop or crc != _chunks.CRC32C_RESIDUE:
                raise Refused(f"{where}: its crc32c does not match its bytes (damaged or changed)")
            stored = int.from_bytes(os.pread(fd, CRC_BYTES, stop - CRC_BYTES), "little")
            if stored != expected:
                raise Refused(differs(where, stored, expected))
    finally:
        os.close(fd)


def link_leaf(
    source: Location,
    j: int,
    target: Location,
    i: int,
    record: LeafRecord,
    *,
    writes: Writes,
    chunks: list[tuple[str, ...]] | None = None,
    nbytes: int | None = None,
) -> int | None:
    """Hard-links ``chunks`` (None: all) of leaf ``j`` of ``source`` into leaf ``i`` of
    ``target``, each checked against ``writes``; the bytes reused, or None (unlinked)."""
    size = chunk_file_bytes(record)
    names = chunk_names(record) if chunks is None else chunks
    links = _Links(source, target)
    try:
        expected = snapshot_crcs(record, writes, names)
        if names:  # another process may not have created the staging item yet
            os.makedirs(links.dst_root, exist_ok=True)
        for *dirs, name in names:
            shown = f"{source}/{array_dir(j)}/{'/'.join((*dirs, name))}"
            src, dst = (*array_dir(j).split("/"), *dirs), (*array_dir(i).split("/"), *dirs)
            dfd = links.link(src, name, dst, name, shown)
            segment = (shown, 0, size, expected[(*dirs, name)])
            check_linked(dfd, name, shown, size, [segment], not_the_snapshot)
        return record.nbytes if nbytes is None else nbytes
    except (Refused, OSError, CheckpointError) as e:
        why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            why += " (no hard links here)"
        logger.warning(
            "incremental save: leaf %r is written, not reused from %s: %s",
            record.path,
            source,
            why,
        )
        links.undo()
        return None
    finally:
        links.close()


class _Links:
    """The directories opened (once each, ``O_NOFOLLOW``) and files linked by one call."""

    def __init__(self, source: Location, target: Location):
        self.src_root, self.dst_root = source.path.rstrip("/"), target.path.rstrip("/")
        self.fds: dict[tuple[str, tuple[str, ...]], int] = {}
        self.linked: list[tuple[int, str, str]] = []  # (dir fd, name, shown path) created here

    def _dir_fd(self, root: str, parts: tuple[str, ...], create: bool) -> int:
        key = (root, parts)
        if key not in self.fds:
            self.fds[key] = _open_dirs(root, list(parts), create=create)
        return self.fds[key]

    def link(self, src: tuple[str, ...], old: str, dst: tuple[str, ...], new: str, shown: str):
        """Links the regular file ``src/old`` as ``dst/new``; returns the fd of ``dst``."""
        sfd = self._dir_fd(self.src_root, src, False)
        dfd = self._dir_fd(self.dst_root, dst, True)
        st = os.stat(old, dir_fd=sfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{shown}: expected a regular file, found mode {st.st_mode:o}")
        os.link(old, new, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        self.linked.append((dfd, new, shown))
        return dfd

    def undo(self) -> None:
        """Unlinks every name this call linked (errors ignored)."""
        for dfd, name, _ in self.linked:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


COPIES_IN_FLIGHT = 16  # per leaf; each is one request, the bytes stay on the server


def copy_leaf(
    copier: _server_copy.Copier,
    source: Location,
    j: int,
    target: Location,
    i: int,
    record: LeafRecord,
    *,
    writes: Writes,
    chunks: list[tuple[str, ...]] | None = None,
    nbytes: int | None = None,
) -> int | None:
    """Copies ``chunks`` (None: all) of leaf ``j`` of ``source`` to leaf ``i`` of ``target``
    on the server, checked (:func:`_listed`, :func:`_copy_checked`); the bytes reused, or
    None (deleted). A chunk damaged under its old trailer is copied as is."""
    size = chunk_file_bytes(record)
    if source.spec | {"path": ""} != target.spec | {"path": ""}:
        return None
    src = (f"{source.path}{array_dir(j)}/{_chunks.CHUNK_DIR}/", f"{source}/d/{j}/c/")
    dst = (f"{target.path}{array_dir(i)}/{_chunks.CHUNK_DIR}/", f"{target}/d/{i}/c/")
    every = {"/".join(parts[1:]) for parts in chunk_names(record)}
    wanted = sorted(every if chunks is None else ("/".join(p[1:]) for p in chunks))
    if not wanted:
        return 0 if nbytes is None else nbytes
    started = False
    try:
        crcs = snapshot_crcs(
            record, writes, [(_chunks.CHUNK_DIR, *name.split("/")) for name in wanted]
        )
        expected = {"/".join(parts[1:]): crc for parts, crc in crcs.items()}
        listed = _listed(copier, src, wanted, every, size)
        started = True
        _copy_checked(copier, src, dst, listed, expected, size)
        return record.nbytes if nbytes is None else nbytes
    except Exception as e:  # noqa: BLE001  (a copier's failure never fails the save)
        why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
        logger.warning(
            "incremental save: leaf %r is written, not copied from %s: %s",
            record.path,
            source,
            why,
        )
        if started:  # this process's copies deleted; errors ignored (the write replaces)
            with contextlib.suppress(OSError):
                for key in copier.list(dst[0]):
                    if key[len(dst[0]) :] in expected:
                        copier.delete(key)
        return None


def _listed(copier, src: tuple, wanted: list[str], every: set[str], size: int) -> dict:
    """``{chunk name: listed object}`` of ``wanted``, each of ``size``, none outside ``every``."""
    listed = {k[len(src[0]) :]: v for k, v in copier.list(src[0]).items()}
    for name in wanted:
        info = listed.get(name)
        if info is None:
            raise Refused(f"{src[1]}{name}: missing")
        if info.size != size:
            raise Refused(f"{src[1]}{name}: expected {size} bytes (one chunk), found {info.size}")
    extra = sorted(set(listed) - every)
    if extra:
        raise Refused(f"{src[1]}{extra[0]}: not a chunk of this leaf")
    return {name: listed[name] for name in wanted}


def _copy_checked(copier, src: tuple, dst: tuple, listed: dict, expected: dict, size: int) -> None:
    """Copies each ``listed`` chunk pinned to the object listed, its trailer first checked
    to be ``expected``'s; then a listing shows each copy as :func:`_same_copy` asks."""

    def check_and_copy(name: str) -> _server_copy.ObjectInfo:
        info = listed[name]
        tail = copier.read_range(src[0] + name, size - CRC_BYTES, size, info)
        stored = int.from_bytes(tail, "little")
        if stored != expected[name]:
            raise Refused(not_the_snapshot(f"{src[1]}{name}", stored, expected[name]))
        return copier.copy(src[0] + name, dst[0] + name, info)

    with concurrent.futures.ThreadPoolExecutor(
        min(COPIES_IN_FLIGHT, len(listed)), thread_name_prefix="fop-copy"
    ) as pool:
        futures = {name: pool.submit(check_and_copy, name) for name in listed}
        answers = {name: f.result() for name, f in futures.items()}  # first error raised
    copied = {k[len(dst[0]) :]: v for k, v in copier.list(dst[0]).items()}
    for name, want in listed.items():
        answer, seen = answers[name], copied.get(name)
        if not _same_copy(want, answer, seen):
            raise Refused(
                f"{dst[1]}{name}: the copy is not the same object as {src[1]}{name} (source "
                f"{want}, copy {answer}, listed {seen})"
            )


def _same_copy(
    source: _server_copy.ObjectInfo,
    answer: _server_copy.ObjectInfo,
    listed: _server_copy.ObjectInfo | None,
) -> bool:
    """The copy's answer and the new key's listing carry the source's size and tag."""
    if listed is None or answer.size != source.size or listed.size != source.size:
        return False
    if source.content_tag and answer.content_tag and source.tag and answer.tag:
        if answer.tag != source.tag:
            return False
    return not (answer.tag and listed.tag and listed.tag != answer.tag)


# -- 5. format version 2: whole data files of the previous step -------------------------

LIVE_FRACTION = 0.5  # a previous data file is taken when this share of it is reused


@dataclasses.dataclass(frozen=True)
class Unchanged:
    """An unchanged leaf this process writes; ``j``: its previous number."""

    j: int
    record: LeafRecord
    chunks: list[tuple[str, ...]]
    writes: Writes
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Taken:
    """What :func:`reuse_files` took; ``unchanged``: every leaf asked about."""

    files: dict[str, int]
    chunks: dict[str, _chunks.Segment]
    leaves: frozenset[int]
    nbytes: int
    unchanged: frozenset[int] = frozenset()


def reuse_files(
    take: Callable[..., None],
    source: Location,
    target: Location,
    process: int,
    unchanged: dict[int, Unchanged],
) -> Taken:
    """Takes the previous data files of ``process`` holding mostly ``unchanged`` leaves."""
    none = Taken({}, {}, frozenset(), 0, frozenset(unchanged))
    try:
        previous = _packed_reader.read_index(source, process)
    except (CheckpointError, OSError) as e:
        logger.warning("incremental save: not reusing data files of %s: %s", source, e)
        return none
    segments = _reusable_segments(previous, unchanged)
    files = _files_to_take(previous, segments, unchanged)
    if not files:
        return none
    names = {old: _chunks.data_file_name(process, n) for n, old in enumerate(files)}
    leaves = frozenset(_whole(segments, files, unchanged))
    segments = {key: (i, seg) for key, (i, seg) in segments.items() if i in leaves}
    done: list[str] = []
    try:
        for old, new in names.items():
            live = [s for s in segments.values() if s[1].file == old]
            take(source, target, old, new, previous.files[old], [seg for _, seg in live])
            done.append(new)
    except Exception as e:  # noqa: BLE001  (a failed link or copy never fails the save)
        why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
        logger.warning("incremental save: data files are written, not reused: %s", why)
        for name in done:  # this call's own names in the staging item
            with contextlib.suppress(OSError, CheckpointError):
                target.delete(f"{_chunks.DATA_DIR}/{name}")
        return none
    chunks = {
        key: dataclasses.replace(seg, file=names[seg.file]) for key, (_, seg) in segments.items()
    }
    nbytes = sum(unchanged[i].nbytes for i in leaves)
    files_taken = {names[f]: previous.files[f] for f in files}
    return Taken(files_taken, chunks, leaves, nbytes, frozenset(unchanged))


def _reusable_segments(
    previous: _chunks.DataIndex, unchanged: dict[int, Unchanged]
) -> dict[str, tuple[int, _chunks.Segment]]:
    """``{new key: (leaf, previous segment)}`` of the leaves whose every chunk matches."""
    out: dict[str, tuple[int, _chunks.Segment]] = {}
    for i, leaf in unchanged.items():
        size = chunk_file_bytes(leaf.record)
        try:
            crcs = snapshot_crcs(leaf.record, leaf.writes, leaf.chunks) if size else {}
        except Refused:
            continue
        mine = {}
        for parts in leaf.chunks:
            name = "/".join(parts)
            seg = previous.chunks.get(f"{array_dir(leaf.j)}/{name}")
            if seg is None or seg.length != size:
                break
            if seg.crc32c != crcs[parts]:
                shown = f"{array_dir(leaf.j)}/{name} ({_chunks.DATA_DIR}/{seg.file})"
                logger.warning(
                    "incremental save: leaf %r is written: %s",
                    leaf.record.path,
                    not_the_snapshot(shown, seg.crc32c, crcs[parts]),
                )
                break
            mine[f"{array_dir(i)}/{name}"] = (i, seg)
        else:
            if leaf.chunks:
                out.update(mine)
    return out


def _whole(segments, files: list[str], unchanged: dict[int, Unchanged]) -> set[int]:
    """The leaves whose every chunk lies in one of ``files``."""
    out = {i for i, _ in segments.values()}
    for i, seg in segments.values():
        if seg.file not in files:
            out.discard(i)
    return out & set(unchanged)


def _files_to_take(previous: _chunks.DataIndex, segments, unchanged) -> list[str]:
    """The previous data files at least LIVE_FRACTION live, to a fixed point."""
    files = list(previous.files)
    while True:
        whole = _whole(segments, files, unchanged)
        live: dict[str, int] = {}
        for i, seg in segments.values():
            if i in whole:
                live[seg.file] = live.get(seg.file, 0) + seg.length
        kept = [f for f in files if live.get(f, 0) and live[f] >= LIVE_FRACTION * previous.files[f]]
        if kept == files:
            return files
        files = kept


def link_file(
    source: Location,
    target: Location,
    old: str,
    new: str,
    size: int,
    live: list[_chunks.Segment],
) -> None:
    """Hard-links ``data/<old>`` of ``source`` as ``data/<new>`` of ``target``, checked."""
    os.makedirs(target.path, exist_ok=True)  # another process may not have yet
    links, shown = _Links(source, target), f"{source}/data/{old}"
    try:
        dfd = links.link((_chunks.DATA_DIR,), old, (_chunks.DATA_DIR,), new, shown)
        segments = [(f"{shown} at {s.offset}", s.offset, s.length, s.crc32c) for s in live]
        differs = lambda where, *_: f"{where}: its crc32c differs from its index's"
        check_linked(dfd, new, shown, size, segments, differs)
    except BaseException:
        links.undo()
        raise
    finally:
        links.close()


def copy_file(
    copier: _server_copy.Copier,
    source: Location,
    target: Location,
    old: str,
    new: str,
    size: int,
    live: list[_chunks.Segment],
) -> None:
    """Server-side copy of ``data/<old>`` as ``target``'s ``data/<new>``, checked (else deleted)."""
    if source.spec | {"path": ""} != target.spec | {"path": ""}:
        raise Refused(f"{target}: not in the bucket of {source}")
    src = f"{source.path}{_chunks.DATA_DIR}/{old}"
    dst = f"{target.path}{_chunks.DATA_DIR}/{new}"
    info = copier.list(src).get(src)
    if info is None or info.size != size:
        raise Refused(f"{source}/data/{old}: expected {size} bytes, found {info}")
    try:
        answer = copier.copy(src, dst, info)
        if not _same_copy(info, answer, copier.list(dst).get(dst)):
            raise Refused(f"{target}/data/{new}: the copy is not the object {src} listed")
    except BaseException:
        with contextlib.suppress(OSError):
            copier.delete(dst)
        raise
