"""Incremental steps: a leaf whose bytes did not change since the previous committed step
of the same manager is taken from that step instead of being written again: hard-linked
on a local filesystem, copied on the server (S3 ``CopyObject``, GCS ``rewriteTo``) on an
object store. Either way every step stays self-contained: retention, ``verify``,
``gc``, export, ``restore_params`` and the tiers see ordinary steps.

Who calls what (all on the background thread of :meth:`_save.Snapshot.write`, after the
blocking phase, on every process; only with :class:`Reuse` given, i.e.
``CheckpointManager(incremental=True)``, whose ``_start_save`` draws the key-value name
``Reuse.op`` of each pytree item on the training thread, in item order, so every process
derives the same one):

0. :func:`reuser` picks the way for the store: :func:`link_leaf` on a local
   filesystem, :func:`copy_leaf` with the copier of ``_server_copy`` on ``s3://`` and
   ``gs://``; none where no copier is available (another kvstore driver such as
   ``memory://``, botocore or google-auth not installed, no credentials): this
   process then writes every leaf, and one WARNING per store and reason says why. A
   missing copier never fails a save. With one process and no way, nothing below runs.
1. Digests (:func:`region_digests`, :func:`exchange`, :func:`leaf_digest`): each
   process hashes every region it writes of each leaf stored as its own array (its
   shard, or its share of chunk rows of a replicated one): ``xxh3_128`` of the
   region's bytes (C order, little endian) together with the region's bounds. With
   several processes these ``(bounds, hash)`` entries go through the jax.distributed
   key-value store: each process sets one compact JSON value under
   ``<Reuse.op>/regions/<process>`` (``{leaf index: [[bounds, hash], ...]}``, array
   leaves only) and reads every process's (the coordination timeout of
   ``_distributed``; a lost process is a :class:`CoordinationError` and the step
   fails, as it would at the commit). A process that could not hash sets ``null``;
   then no process records a digest or reuses anything in that item. The leaf's
   digest (``xxh3_128r``, FORMAT.md) is a hash over every process's entries sorted by
   region: equal digests mean the same partition into regions and the same bytes in
   each. It is recorded in the leaf's record in ``_METADATA.json`` (optional field
   ``digest``), identical on every process, before the primary encodes that file.
   After the step's commit (whatever its outcome every process has read every value
   by then) each process deletes its own value (:func:`release`).
2. :func:`previous_document` reads the same item of the previous committed step: its
   ``_METADATA.json`` checked against the sha256 in that step's manifest (written by
   any number of processes: the digest carries the partition).
3. :func:`plan_reuse` picks the leaves whose path, kind, shape, dtype, storage kind,
   chunk shape and digest all equal the previous record's; any difference: written.
   Every process reads the same records, so every process decides alike; a process
   that decides otherwise (it could not read the previous step) only writes bytes
   the others would have linked: the step is the same either way.
4. Each process reuses only the chunks of its own regions (:func:`chunks_of`: the
   chunk grid of the record's ``chunk_shape``; a region not on chunk boundaries is
   written). Local filesystems: :func:`link_leaf` hard-links those chunk files of the
   previous ``d/<j>/c/...`` into the staging ``d/<i>/c/...`` (the primary writes every
   ``zarr.json`` fresh, as for any leaf), then checks each linked file: a regular file
   (a symlink is never followed: ``linkat`` without ``AT_SYMLINK_FOLLOW``, opened
   with ``O_NOFOLLOW``), of the exact size a chunk has, whose crc32c trailer matches
   its bytes *and equals the crc32c of the snapshot's bytes for that chunk*
   (:func:`snapshot_crcs`: the trailer the writer would store for it, over the same
   encoding, edge chunks zero-padded): the digest matched the snapshot, this proves
   the linked file holds the same bytes, up to crc32c. Any failure (a missing file,
   another size, a bad checksum, another crc32c than the snapshot's, a filesystem
   without hard links) removes what this process linked for that leaf and it writes
   its regions of the leaf from its snapshot (the other processes' chunks, linked or
   written, hold the same bytes). Compressed leaves are never reused
   (:func:`plan_reuse`): their stored bytes have no fixed size, and comparing them
   would mean compressing the snapshot, the write's cost.
5. Object stores: :func:`copy_leaf` lists the previous step's ``d/<j>/c/`` keys (every
   chunk is stored, fill values included, so the listing must name exactly the leaf's
   chunks, each of the size a chunk has), copies this process's chunks on the server
   to the new step's ``d/<i>/c/...`` (up to :data:`COPIES_IN_FLIGHT` at once per
   leaf, a few leaves at once; each copy only from the object listed: S3 ``If-Match``
   its ETag, GCS ``ifSourceGenerationMatch``), then lists the new keys and checks each
   of its copies against its source: the same size, and the same content tag (S3
   ETag, GCS crc32c and md5) where the tag is a hash of the bytes (not an S3
   multipart or SSE-KMS ETag; the new key's listing must then show the tag the copy
   answered). Before each copy, the source's crc32c trailer (its last 4 bytes: one
   ranged GET, pinned to the object listed as the copy is) must equal the crc32c of
   the snapshot's bytes for that chunk. Any failure deletes this process's copies of
   the leaf and it writes its regions from its snapshot (logged). The rest of the
   source is not read (that would bring the bytes here): a previous chunk damaged in
   place under its old trailer is copied as is, and restore and ``verify`` report it
   in both steps (never silently wrong).

``bytes_reused`` is per process (the bytes of its regions it linked or copied); the
manifest records the step's ``bytes`` only for one-process steps.

Deleting a step stays a plain delete. Local: removing a step unlinks its names, and
the data stays while any other step links it. What is *not* protected: a linked file
shares its inode with the earlier step, so damage done to it in place after the link
shows in every step that links it (restore and ``verify`` still detect it through the
chunk's crc32c, but the earlier step is then no independent copy of that leaf). An
edit of the previous step that also rewrites the crc32c trailer before the link is
refused (its crc32c is not the snapshot's), unless it was crafted to keep the
chunk's crc32c (crc32c is a checksum, not a cryptographic hash). Object stores: a copy is an
object of its own; the store bills it as stored bytes (no saving in storage, only in
bytes sent and save time).

Steps recorded with the earlier whole-leaf digest (``xxh3_128``, one process only)
never match the region digest: the step after one is written in full once.
"""

from __future__ import annotations

import concurrent.futures
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

import numpy as np
import xxhash

from .._base import distributed as _distributed
from .._errors import CheckpointError
from .._format import steps as _steps
from .._format.documents import read_document
from .._format.layout import (
    ArrayStorage,
    CheckpointDocument,
    LeafRecord,
    array_dir,
    dtype_from_name,
)
from .._storage import server_copy as _server_copy
from .._storage.location import Location, _open_dirs
from .._zarr import chunks as _chunks

logger = logging.getLogger("flax_orbax_plugin")

DIGEST_ALGORITHM = "xxh3_128r"  # a hash over (region bounds, xxh3_128 of its bytes)
_CRC32C_RESIDUE = _chunks.CRC32C_RESIDUE
_CRC_BYTES = _chunks.CRC_BYTES
_READ_BLOCK = 8 << 20


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


def reuser(location: Location) -> Callable[..., int | None] | None:
    """How this process reuses its chunks of unchanged leaves under ``location``:
    :func:`link_leaf` on a local filesystem, :func:`copy_leaf` with the store's
    server-side copier on S3 and GCS; None (it writes every leaf) where no copier is
    available (logged once per store and reason)."""
    if location.is_local:
        return link_leaf
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
    return functools.partial(copy_leaf, copier)


# -- 1. digests ---------------------------------------------------------------------------

Bounds = tuple[tuple[int, int], ...]  # (start, stop) per axis, in the leaf's coordinates
Entry = tuple[Bounds, str]  # a region and the xxh3_128 hex of its bytes
Writes = list[tuple[tuple[slice, ...], np.ndarray]]  # a leaf's (region, data) to write


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


def exchange(op: str | None, mine: dict[int, list[Entry]] | None) -> dict[int, list[Entry]] | None:
    """Every process's entries, merged per leaf index; ``mine`` (None: this process
    could not hash) as is with one process. With several, one key-value set of this
    process's JSON under ``<op>/regions/<process>`` and one blocking get per process
    (the coordination timeout; a lost process raises :class:`CoordinationError`).
    None when any process sent ``null`` (or ``op`` is None): nobody gets a digest.

    Background thread, same call order on every process; :func:`release` deletes the
    value once every process has read it."""
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
    _distributed.publish(f"{op}/regions", text)
    merged: dict[int, list[Entry]] = {}
    failed = False
    for value in _distributed.gather_str(f"{op}/regions"):  # every value read, always
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
        manifest = _steps.read_manifest(reuse.previous_step)
        entry = manifest.items.get(reuse.item)
        if entry is None or entry.kind != "pytree":
            return None
        location = reuse.previous_step.child(entry.dir)
        doc = read_document(location)
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
            and old.impl == rec.impl
        ):
            out[i] = j
    return out


# -- 4. linking -----------------------------------------------------------------------------


def chunk_names(record: LeafRecord) -> list[tuple[str, ...]]:
    """Every chunk file of an array leaf, as path parts under ``d/<i>/`` (zarr3 default
    chunk key encoding: ``c/<i0>/<i1>/...``)."""
    chunk = record.storage.chunk_shape
    grid = [max(1, -(-s // c)) for s, c in zip(record.shape, chunk, strict=True)]
    return [_chunks.chunk_parts(idx) for idx in itertools.product(*(range(g) for g in grid))]


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


def chunk_file_bytes(record: LeafRecord) -> int | None:
    """Size of each stored chunk file (a full chunk, edge chunks padded, plus crc32c);
    None for a dtype stored in less than one byte per element (not reused)."""
    itemsize = dtype_from_name(record.dtype).itemsize
    if record.dtype in ("int4", "uint4") or itemsize < 1:
        return None
    return math.prod(record.storage.chunk_shape) * itemsize + _CRC_BYTES


class _Refused(Exception):
    """One linked file fails a check: the leaf is written instead."""


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
    """Hard-links the chunk files ``chunks`` (all of them when None) of leaf ``j`` of
    ``source`` (the previous step's item) into leaf ``i`` of ``target`` (the staging
    item) and checks them, each against the crc32c of its bytes in ``writes`` (this
    process's snapshot of the leaf: ``(region, data)`` pairs covering ``chunks``);
    returns ``nbytes`` (the bytes reused; the leaf's when None), or None after removing
    whatever it linked (the caller writes those chunks)."""
    size = chunk_file_bytes(record)
    if size is None:
        return None
    src_root, dst_root = source.path.rstrip("/"), target.path.rstrip("/")
    names = chunk_names(record) if chunks is None else chunks
    fds: dict[tuple[str, tuple[str, ...]], int] = {}
    linked: list[tuple[int, str, str]] = []  # (dir fd, name, shown path) created here

    def dir_fd(root: str, parts: tuple[str, ...], create: bool) -> int:
        key = (root, parts)
        if key not in fds:
            fds[key] = _open_dirs(root, list(parts), create=create)
        return fds[key]

    try:
        expected = snapshot_crcs(record, writes, names)
        if names:  # another process may not have created the staging item yet
            os.makedirs(dst_root, exist_ok=True)
        for parts in names:
            *dirs, name = parts
            shown = f"{source}/{array_dir(j)}/{'/'.join(parts)}"
            sfd = dir_fd(src_root, (*array_dir(j).split("/"), *dirs), False)
            dfd = dir_fd(dst_root, (*array_dir(i).split("/"), *dirs), True)
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise _Refused(f"{shown}: expected a regular file, found mode {st.st_mode:o}")
            os.link(name, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
            linked.append((dfd, name, shown))
            _check_linked(dfd, name, shown, size, expected[parts])
        return record.nbytes if nbytes is None else nbytes
    except (_Refused, OSError, CheckpointError) as e:
        why = str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            why += " (no hard links here)"
        logger.warning(
            "incremental save: leaf %r is written, not reused from %s: %s",
            record.path,
            source,
            why,
        )
        for dfd, name, _ in linked:
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass
        return None
    finally:
        for fd in fds.values():
            os.close(fd)


def _check_linked(dfd: int, name: str, shown: str, size: int, expected: int) -> None:
    """The file just linked (its inode can no longer be swapped under the name we own):
    a regular file of ``size`` bytes whose crc32c trailer matches its bytes and equals
    ``expected``, the crc32c of the snapshot's bytes for that chunk."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(f"{shown}: expected a regular file")
        if st.st_size != size:
            raise _Refused(f"{shown}: expected {size} bytes (one chunk), found {st.st_size}")
        crc, seen = 0, 0
        with os.fdopen(os.dup(fd), "rb") as f:
            while block := f.read(_READ_BLOCK):  # streamed: a chunk may be large
                crc = _chunks.extend_crc(crc, block)
                seen += len(block)
        if seen != size or crc != _CRC32C_RESIDUE:
            raise _Refused(f"{shown}: its crc32c does not match its bytes (damaged or changed)")
        stored = int.from_bytes(os.pread(fd, _CRC_BYTES, size - _CRC_BYTES), "little")
        if stored != expected:
            raise _Refused(_not_the_snapshot(shown, stored, expected))
    finally:
        os.close(fd)


def _not_the_snapshot(shown: str, stored: int, expected: int) -> str:
    return (
        f"{shown}: its crc32c {stored:08x} is not that of the snapshot's bytes for this "
        f"chunk ({expected:08x}): it holds other bytes than its leaf's recorded digest says"
    )


def snapshot_crcs(
    record: LeafRecord, writes: Writes, names: Iterable[tuple[str, ...]]
) -> dict[tuple[str, ...], int]:
    """``{chunk name: crc32c}`` for ``names`` (as :func:`chunk_names`): the crc32c trailer
    each chunk file would get if written from ``writes`` (``_chunks.chunk_crcs``:
    the stored encoding, edge chunks zero-padded). Raises :class:`_Refused` for a name
    that no region of ``writes`` covers whole (nothing to compare it with)."""
    shape, chunk = tuple(record.shape), tuple(record.storage.chunk_shape)
    wanted = set(names)
    out: dict[tuple[str, ...], int] = {}
    for region, data in writes:
        if not data.size:
            continue
        try:
            crcs = _chunks.chunk_crcs(shape, chunk, region, data)
        except (ValueError, TypeError) as e:  # a region this function cannot encode
            raise _Refused(f"the snapshot's crc32c per chunk: {type(e).__name__}: {e}") from e
        for cell, crc in (crcs or {}).items():
            if _chunks.chunk_parts(cell) in wanted:
                out[_chunks.chunk_parts(cell)] = crc
    missing = sorted(wanted - set(out))
    if missing:
        raise _Refused(
            f"chunk {'/'.join(missing[0])}: not whole in this process's snapshot of the leaf"
            " (nothing to compare the previous chunk with)"
        )
    return out


# -- 4'. server-side copies (object stores) ---------------------------------------------

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
    """Copies the chunk objects ``chunks`` (all of them when None) of leaf ``j`` of
    ``source`` (the previous step's item) to leaf ``i`` of ``target`` (the new step's
    item) on the server, then checks them; returns ``nbytes`` (the bytes reused; the
    leaf's when None), or None after deleting whatever it copied (the caller writes
    those chunks; the other processes' copies are theirs).

    Checked: the previous step lists exactly the leaf's chunk objects (every chunk is
    stored, fill values included), each of the size a chunk has; each copy is made
    only from the object listed (S3 ``If-Match`` its ETag, GCS its generation); each
    copy's answer carries the source's content tag (S3 ETag, GCS crc32c and md5; not
    compared where the tag is no hash of the bytes: S3 multipart or SSE-KMS/SSE-C),
    and a listing of the new keys afterwards shows each of the source's size and the
    tag the copy answered (:func:`_same_copy`); and before each copy, the source's
    crc32c trailer (its last 4 bytes, one ranged read pinned to the object listed)
    equals the crc32c of the snapshot's bytes for that chunk (``writes``, this
    process's ``(region, data)`` pairs of the leaf): a chunk edited and resealed is
    refused. The source's other bytes are not read here: a chunk damaged in place
    under its old trailer is copied as is, and restore and ``verify`` report it in
    both steps (never silently wrong)."""
    size = chunk_file_bytes(record)
    if size is None or source.spec | {"path": ""} != target.spec | {"path": ""}:
        return None
    src_prefix = f"{source.path}{array_dir(j)}/{_chunks.CHUNK_DIR}/"
    dst_prefix = f"{target.path}{array_dir(i)}/{_chunks.CHUNK_DIR}/"
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
        listed = {k[len(src_prefix) :]: v for k, v in copier.list(src_prefix).items()}
        for name in wanted:
            info = listed.get(name)
            if info is None:
                raise _Refused(f"{source}/d/{j}/c/{name}: missing")
            if info.size != size:
                raise _Refused(
                    f"{source}/d/{j}/c/{name}: expected {size} bytes (one chunk), found {info.size}"
                )
        extra = sorted(set(listed) - every)
        if extra:
            raise _Refused(f"{source}/d/{j}/c/{extra[0]}: not a chunk of this leaf")
        started = True

        def check_and_copy(name: str) -> _server_copy.ObjectInfo:
            info = listed[name]
            tail = copier.read_range(src_prefix + name, size - _CRC_BYTES, size, info)
            stored = int.from_bytes(tail, "little")
            if stored != expected[name]:
                raise _Refused(
                    _not_the_snapshot(f"{source}/d/{j}/c/{name}", stored, expected[name])
                )
            return copier.copy(src_prefix + name, dst_prefix + name, info)

        with concurrent.futures.ThreadPoolExecutor(
            min(COPIES_IN_FLIGHT, len(wanted)), thread_name_prefix="fop-copy"
        ) as pool:
            futures = {name: pool.submit(check_and_copy, name) for name in wanted}
            answers = {name: f.result() for name, f in futures.items()}  # first error raised
        copied = {k[len(dst_prefix) :]: v for k, v in copier.list(dst_prefix).items()}
        for name in wanted:
            want, answer, seen = listed[name], answers[name], copied.get(name)
            if not _same_copy(want, answer, seen):
                raise _Refused(
                    f"{target}/d/{i}/c/{name}: the copy is not the same object as "
                    f"{source}/d/{j}/c/{name} (source {want}, copy {answer}, listed {seen})"
                )
        return record.nbytes if nbytes is None else nbytes
    except Exception as e:  # noqa: BLE001  (a copier's failure never fails the save)
        why = str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
        logger.warning(
            "incremental save: leaf %r is written, not copied from %s: %s",
            record.path,
            source,
            why,
        )
        if started:
            _delete_copies(copier, dst_prefix, wanted)
        return None


def _same_copy(
    source: _server_copy.ObjectInfo,
    answer: _server_copy.ObjectInfo,
    listed: _server_copy.ObjectInfo | None,
) -> bool:
    """The copy's answer has the source's size and, where both tags are content tags,
    its tag; the new key's listing has that size and the answer's tag (the object the
    copy made, unchanged since)."""
    if listed is None or answer.size != source.size or listed.size != source.size:
        return False
    if source.content_tag and answer.content_tag and source.tag and answer.tag:
        if answer.tag != source.tag:
            return False
    return not (answer.tag and listed.tag and listed.tag != answer.tag)


def _delete_copies(copier: _server_copy.Copier, prefix: str, names: list[str]) -> None:
    """Deletes the objects ``prefix + name`` for ``names`` (this process's chunks of one
    leaf of the new step, which only this save writes; other processes' chunks under
    ``prefix`` are left alone); errors are ignored (the write replaces them)."""
    mine = set(names)
    try:
        for key in copier.list(prefix):
            if key[len(prefix) :] in mine:
                copier.delete(key)
    except OSError:
        pass
