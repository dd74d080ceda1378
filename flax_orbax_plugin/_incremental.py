"""Incremental steps: a leaf whose bytes did not change since the previous committed step
of the same manager is taken from that step instead of being written again: hard-linked
on a local filesystem, copied on the server (S3 ``CopyObject``, GCS ``rewriteTo``) on an
object store. Either way every step stays self-contained: retention, ``verify``,
``gc``, export, ``restore_params`` and the tiers see ordinary steps.

Who calls what (all on the background thread of :meth:`_save.Snapshot.write`, after the
blocking phase; only with :class:`Reuse` given, i.e. ``CheckpointManager(incremental=
True)``; only where :func:`reuser` offers a way, otherwise nothing here runs):

0. :func:`reuser` picks the way for the store: :func:`link_leaf` on a local
   filesystem, :func:`copy_leaf` with the copier of ``_server_copy`` on ``s3://`` and
   ``gs://``; none with several processes, nor where no copier is available (another
   kvstore driver such as ``memory://``, botocore or google-auth not installed, no
   credentials): every leaf is then written, and one WARNING per store and reason says
   why. A missing copier never fails a save.
1. :func:`leaf_digest` hashes each leaf stored as its own array (``xxh3_128`` of its
   host snapshot bytes, C order, little endian); the digest is recorded in the leaf's
   record in ``_METADATA.json`` (optional field ``digest``, FORMAT.md).
2. :func:`previous_document` reads the same item of the previous committed step: its
   ``_METADATA.json`` checked against the sha256 in that step's manifest.
3. :func:`plan_reuse` picks the leaves whose path, kind, shape, dtype, storage kind,
   chunk shape and digest all equal the previous record's; any difference: written.
4. Local filesystems: :func:`link_leaf` hard-links every chunk file of the previous
   ``d/<j>/c/...`` into the staging ``d/<i>/c/...`` (``zarr.json`` is written fresh,
   as for any leaf), then checks each linked file: a regular file (a symlink is never
   followed: ``linkat`` without ``AT_SYMLINK_FOLLOW``, opened with ``O_NOFOLLOW``), of
   the exact size a chunk has, whose crc32c trailer matches its bytes. Any failure (a
   missing file, another size, a bad checksum, a filesystem without hard links)
   removes what it linked for that leaf and the leaf is written from the snapshot.
5. Object stores: :func:`copy_leaf` lists the previous step's ``d/<j>/c/`` keys (every
   chunk is stored, fill values included, so the listing must name exactly the leaf's
   chunks, each of the size a chunk has), copies each on the server to the new step's
   ``d/<i>/c/...`` (up to :data:`COPIES_IN_FLIGHT` at once per leaf, a few leaves at
   once; each copy only from the object listed: S3 ``If-Match`` its ETag, GCS
   ``ifSourceGenerationMatch``), then lists the new keys and checks each copy against
   its source: the same size, and the same content tag (S3 ETag, GCS crc32c and md5)
   where the tag is a hash of the bytes (not an S3 multipart or SSE-KMS ETag; the new
   key's listing must then show the tag the copy answered). Any failure deletes the
   leaf's copies and the leaf is written from the snapshot (logged). The crc32c
   trailers are not read (that would bring the bytes here): a previous chunk damaged
   in place at its own size is copied as is, and restore and ``verify`` report it in
   both steps.

Deleting a step stays a plain delete. Local: removing a step unlinks its names, and
the data stays while any other step links it. What is *not* protected: a linked file
shares its inode with the earlier step, so damage done to it in place after the link
shows in every step that links it (restore and ``verify`` still detect it through the
chunk's crc32c, but the earlier step is then no independent copy of that leaf); a
deliberate edit that also rewrites the crc32c trailer before the link is not detected
(the digest covers the snapshot, not the previous file). Object stores: a copy is an
object of its own; the store bills it as stored bytes (no saving in storage, only in
bytes sent and save time).

Not reused (every step written in full): several processes (a leaf's digest would
need every writer's bytes, or one digest per writer exchanged before the metadata is
written; each process would then link or copy the chunks it owns).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import functools
import itertools
import logging
import math
import os
import stat
import threading
from collections.abc import Callable, Iterable

import google_crc32c
import numpy as np
import xxhash

from . import _server_copy
from ._errors import CheckpointError
from ._layout import ArrayStorage, CheckpointDocument, LeafRecord
from ._storage import Location, _open_dirs

logger = logging.getLogger("flax_orbax_plugin")

DIGEST_ALGORITHM = "xxh3_128"
_CRC32C_RESIDUE = 0x48674BC7  # crc32c of any message followed by its own crc32c (LE)
_CRC_BYTES = 4
_READ_BLOCK = 8 << 20


@dataclasses.dataclass(frozen=True)
class Reuse:
    """Opt-in incremental save of one pytree item of a manager step: record leaf digests
    and reuse the unchanged leaves of ``item`` in ``previous_step`` (the previous
    committed step's directory; None for the first step)."""

    previous_step: Location | None
    item: str


_LOGGED: set[tuple[str, str]] = set()
_LOGGED_LOCK = threading.Lock()


def reuser(location: Location, process_count: int) -> Callable[..., int | None] | None:
    """How unchanged leaves are reused under ``location``: :func:`link_leaf` on a local
    filesystem, :func:`copy_leaf` with the store's server-side copier on S3 and GCS;
    None (every leaf written) with several processes or where no copier is available
    (logged once per store and reason)."""
    if process_count != 1:
        return None
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


def leaf_digest(record: LeafRecord, writes: Iterable[tuple[tuple[slice, ...], np.ndarray]]):
    """``"xxh3_128:<hex>"`` of the leaf's bytes in C order (numpy's in-memory form,
    little endian), or None when ``writes`` do not cover it as consecutive slabs of
    axis 0 (e.g. sharded along another axis): such a leaf is never reused."""
    shape = tuple(record.shape)
    parts = []
    for region, data in writes:
        bounds = [s.indices(n)[:2] for s, n in zip(region, shape, strict=True)]
        if any(b != (0, n) for b, n in zip(bounds[1:], shape[1:], strict=True)):
            return None
        if data.dtype.byteorder == ">" or tuple(data.shape) != tuple(b - a for a, b in bounds):
            return None
        parts.append((bounds[0][0] if bounds else 0, data))
    parts.sort(key=lambda p: p[0])
    h = xxhash.xxh3_128()
    at = 0
    for start, data in parts:
        if shape and start != at:
            return None
        at = start + (data.shape[0] if shape else 1)
        h.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if at != (shape[0] if shape else 1) or (not shape and len(parts) != 1):
        return None
    return f"{DIGEST_ALGORITHM}:{h.hexdigest()}"


# -- 2./3. the previous step and what to reuse ---------------------------------------------


def previous_document(reuse: Reuse) -> tuple[Location, CheckpointDocument] | None:
    """The previous step's item location and checked metadata; None (logged) when there
    is none, it is not a pytree of one process, or it does not read cleanly."""
    from . import _restore, _steps  # _restore imports _save, which imports this module

    if reuse.previous_step is None:
        return None
    try:
        manifest = _steps.read_manifest(reuse.previous_step)
        entry = manifest.items.get(reuse.item)
        if entry is None or entry.kind != "pytree":
            return None
        location = reuse.previous_step.child(entry.dir)
        doc = _restore.read_document(location)
    except (CheckpointError, OSError) as e:
        logger.warning("incremental save: not reusing %s: %s", reuse.previous_step, e)
        return None
    if doc.process_count != 1:
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
    return [("c", *map(str, idx)) for idx in itertools.product(*(range(g) for g in grid))]


def chunk_file_bytes(record: LeafRecord) -> int | None:
    """Size of each stored chunk file (a full chunk, edge chunks padded, plus crc32c);
    None for a dtype stored in less than one byte per element (not reused)."""
    from ._layout import dtype_from_name

    itemsize = dtype_from_name(record.dtype).itemsize
    if record.dtype in ("int4", "uint4") or itemsize < 1:
        return None
    return math.prod(record.storage.chunk_shape) * itemsize + _CRC_BYTES


class _Refused(Exception):
    """One linked file fails a check: the leaf is written instead."""


def link_leaf(source: Location, j: int, target: Location, i: int, record: LeafRecord) -> int | None:
    """Hard-links the chunk files of leaf ``j`` of ``source`` (the previous step's item)
    into leaf ``i`` of ``target`` (the staging item) and checks them; returns the bytes
    reused, or None after removing whatever it linked (the caller writes the leaf)."""
    size = chunk_file_bytes(record)
    if size is None:
        return None
    src_root, dst_root = source.path.rstrip("/"), target.path.rstrip("/")
    fds: dict[tuple[str, tuple[str, ...]], int] = {}
    linked: list[tuple[int, str, str]] = []  # (dir fd, name, shown path) created here

    def dir_fd(root: str, parts: tuple[str, ...], create: bool) -> int:
        key = (root, parts)
        if key not in fds:
            fds[key] = _open_dirs(root, list(parts), create=create)
        return fds[key]

    try:
        for parts in chunk_names(record):
            *dirs, name = parts
            shown = f"{source}/d/{j}/{'/'.join(parts)}"
            sfd = dir_fd(src_root, ("d", str(j), *dirs), False)
            dfd = dir_fd(dst_root, ("d", str(i), *dirs), True)
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise _Refused(f"{shown}: expected a regular file, found mode {st.st_mode:o}")
            os.link(name, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
            linked.append((dfd, name, shown))
            _check_linked(dfd, name, shown, size)
        return record.nbytes
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


def _check_linked(dfd: int, name: str, shown: str, size: int) -> None:
    """The file just linked (its inode can no longer be swapped under the name we own):
    a regular file of ``size`` bytes whose crc32c trailer matches its bytes."""
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
                crc = google_crc32c.extend(crc, block)
                seen += len(block)
        if seen != size or crc != _CRC32C_RESIDUE:
            raise _Refused(f"{shown}: its crc32c does not match its bytes (damaged or changed)")
    finally:
        os.close(fd)


# -- 4'. server-side copies (object stores) ---------------------------------------------

COPIES_IN_FLIGHT = 16  # per leaf; each is one request, the bytes stay on the server


def copy_leaf(
    copier: _server_copy.Copier,
    source: Location,
    j: int,
    target: Location,
    i: int,
    record: LeafRecord,
) -> int | None:
    """Copies the chunk objects of leaf ``j`` of ``source`` (the previous step's item)
    to leaf ``i`` of ``target`` (the new step's item) on the server, then checks them;
    returns the bytes reused, or None after deleting whatever it copied (the caller
    writes the leaf).

    Checked: the previous step lists exactly the leaf's chunk objects (every chunk is
    stored, fill values included), each of the size a chunk has; each copy is made
    only from the object listed (S3 ``If-Match`` its ETag, GCS its generation); each
    copy's answer carries the source's content tag (S3 ETag, GCS crc32c and md5; not
    compared where the tag is no hash of the bytes: S3 multipart or SSE-KMS/SSE-C),
    and a listing of the new keys afterwards shows each of the source's size and the
    tag the copy answered (:func:`_same_copy`). Not checked: the crc32c
    trailer (that would read the bytes here); a chunk damaged in place at the same
    size is copied as is, and restore and ``verify`` report it in both steps."""
    size = chunk_file_bytes(record)
    if size is None or source.spec | {"path": ""} != target.spec | {"path": ""}:
        return None
    src_prefix, dst_prefix = f"{source.path}d/{j}/c/", f"{target.path}d/{i}/c/"
    wanted = sorted("/".join(parts[1:]) for parts in chunk_names(record))
    started = False
    try:
        listed = {k[len(src_prefix) :]: v for k, v in copier.list(src_prefix).items()}
        for name in wanted:
            info = listed.get(name)
            if info is None:
                raise _Refused(f"{source}/d/{j}/c/{name}: missing")
            if info.size != size:
                raise _Refused(
                    f"{source}/d/{j}/c/{name}: expected {size} bytes (one chunk), found {info.size}"
                )
        extra = sorted(set(listed) - set(wanted))
        if extra:
            raise _Refused(f"{source}/d/{j}/c/{extra[0]}: not a chunk of this leaf")
        started = True
        with concurrent.futures.ThreadPoolExecutor(
            min(COPIES_IN_FLIGHT, len(wanted)), thread_name_prefix="fop-copy"
        ) as pool:
            futures = {
                name: pool.submit(copier.copy, src_prefix + name, dst_prefix + name, listed[name])
                for name in wanted
            }
            answers = {name: f.result() for name, f in futures.items()}  # first error raised
        copied = {k[len(dst_prefix) :]: v for k, v in copier.list(dst_prefix).items()}
        for name in wanted:
            want, answer, seen = listed[name], answers[name], copied.get(name)
            if not _same_copy(want, answer, seen):
                raise _Refused(
                    f"{target}/d/{i}/c/{name}: the copy is not the same object as "
                    f"{source}/d/{j}/c/{name} (source {want}, copy {answer}, listed {seen})"
                )
        return record.nbytes
    except Exception as e:  # noqa: BLE001  (a copier's failure never fails the save)
        why = str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
        logger.warning(
            "incremental save: leaf %r is written, not copied from %s: %s",
            record.path,
            source,
            why,
        )
        if started:
            _delete_copies(copier, dst_prefix)
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


def _delete_copies(copier: _server_copy.Copier, prefix: str) -> None:
    """Deletes every object under ``prefix`` (the chunks of one leaf of the new step,
    which only this save writes); errors are ignored (the leaf's write replaces them)."""
    try:
        for key in copier.list(prefix):
            copier.delete(key)
    except OSError:
        pass
