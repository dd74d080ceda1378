"""A reused leaf's chunk files: names, size, the crc32c the snapshot's bytes give each, and
their reuse: hard links on a local filesystem (:func:`link_leaf`, no symlink followed),
server-side copies on an object store (:func:`copy_leaf`), each checked before and
after; any failure removes what was linked or copied, and the leaf is written (never
failing the save). A save's background thread, every process. ``docs/incremental.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import math
import os
import stat
from collections.abc import Iterable

import numpy as np

from .._errors import CheckpointError
from .._format.layout import LeafRecord, array_dir, dtype_from_name
from .._storage import server_copy as _server_copy
from .._storage.local_files import open_dirs as _open_dirs
from .._storage.location import Location
from .._zarr import chunks as _chunks

logger = logging.getLogger("flax_orbax_plugin")

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
    """``{chunk name: crc32c}``: the trailer each chunk of ``names`` would get if written
    from ``writes``; :class:`Refused` for one no region covers whole."""
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
    """Checks the file just linked as ``name`` in ``dfd`` (``shown``: its source; its inode
    can no longer be swapped under our name): a regular file of ``size`` bytes in which
    each ``(where, offset, length, crc)`` segment's trailer matches its bytes and equals
    ``crc`` (else :class:`Refused`, ``differs(where, stored, crc)`` its words)."""
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
    ``target``, each checked against its crc32c in ``writes`` (this process's snapshot);
    returns the bytes reused (``nbytes``, or the leaf's), or None after unlinking them."""
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
        """Links the regular file ``src/old`` (folders under the source root) as ``dst/new``
        (created under the target root); returns the fd of ``dst``."""
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
    on the server; returns the bytes reused (``nbytes``, or the leaf's), or None after
    deleting whatever it copied. Checked first: the previous step lists exactly the
    leaf's chunks, each of a chunk's size; then :func:`_copy_checked`. A chunk damaged
    under its old trailer is copied as is: restore and ``verify`` say so in both steps."""
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
    """``{chunk name: listed object}`` of each chunk ``wanted``, every one listed under
    ``src`` (key prefix, shown prefix) with a chunk's ``size``, and no chunk not in ``every``."""
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
    """Copies each ``listed`` chunk (``src``, ``dst``: (key prefix, shown prefix)), pinned to
    the object listed (S3 ``If-Match``, GCS generation), its source's crc32c trailer first
    checked to be ``expected``'s; then a listing shows each copy as :func:`_same_copy` asks."""

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
