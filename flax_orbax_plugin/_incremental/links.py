"""Reuse on a local filesystem: hard links to the previous step's chunk files.

:func:`link_leaf` hard-links this process's chunk files of an unchanged leaf from the
previous step into the staging item (``linkat`` without ``AT_SYMLINK_FOLLOW``: a
symlink is never followed), then checks each linked file: a regular file of a chunk's
size whose crc32c trailer matches its bytes and equals the snapshot's (:mod:`.chunks`).
Any failure removes what it linked and the caller writes the leaf. Called on the
background thread of a save, on every process. Design: ``docs/incremental.md``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from .._errors import CheckpointError
from .._format.layout import LeafRecord, array_dir
from .._storage.local_files import open_dirs as _open_dirs
from .._storage.location import Location
from .._zarr import chunks as _chunks
from .._zarr import crcs as _crcs
from .chunks import (
    CRC_BYTES,
    Refused,
    Writes,
    chunk_file_bytes,
    chunk_names,
    not_the_snapshot,
    snapshot_crcs,
)

logger = logging.getLogger("flax_orbax_plugin")

_CRC32C_RESIDUE = _chunks.CRC32C_RESIDUE
_READ_BLOCK = 8 << 20


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
    names = chunk_names(record) if chunks is None else chunks
    links = _Links(source, target)
    try:
        expected = snapshot_crcs(record, writes, names)
        if names:  # another process may not have created the staging item yet
            os.makedirs(links.dst_root, exist_ok=True)
        for parts in names:
            shown = f"{source}/{array_dir(j)}/{'/'.join(parts)}"
            dfd, name = links.link(parts, j, i, shown)
            _check_linked(dfd, name, shown, size, expected[parts])
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
    """The directories opened and the files linked by one :func:`link_leaf` call (one
    thread): every directory opened once, with ``O_NOFOLLOW`` on each part."""

    def __init__(self, source: Location, target: Location):
        self.src_root, self.dst_root = source.path.rstrip("/"), target.path.rstrip("/")
        self.fds: dict[tuple[str, tuple[str, ...]], int] = {}
        self.linked: list[tuple[int, str, str]] = []  # (dir fd, name, shown path) created here

    def _dir_fd(self, root: str, parts: tuple[str, ...], create: bool) -> int:
        key = (root, parts)
        if key not in self.fds:
            self.fds[key] = _open_dirs(root, list(parts), create=create)
        return self.fds[key]

    def link(self, parts: tuple[str, ...], j: int, i: int, shown: str) -> tuple[int, str]:
        """Links chunk ``parts`` of leaf ``j`` (a regular file, never followed) as the same
        chunk of leaf ``i``; returns (the new name's directory fd, the name)."""
        *dirs, name = parts
        sfd = self._dir_fd(self.src_root, (*array_dir(j).split("/"), *dirs), False)
        dfd = self._dir_fd(self.dst_root, (*array_dir(i).split("/"), *dirs), True)
        st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{shown}: expected a regular file, found mode {st.st_mode:o}")
        os.link(name, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        self.linked.append((dfd, name, shown))
        return dfd, name

    def undo(self) -> None:
        """Unlinks every name this call linked (errors ignored)."""
        for dfd, name, _ in self.linked:
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _check_linked(dfd: int, name: str, shown: str, size: int, expected: int) -> None:
    """The file just linked (its inode can no longer be swapped under the name we own):
    a regular file of ``size`` bytes whose crc32c trailer matches its bytes and equals
    ``expected``, the crc32c of the snapshot's bytes for that chunk."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{shown}: expected a regular file")
        if st.st_size != size:
            raise Refused(f"{shown}: expected {size} bytes (one chunk), found {st.st_size}")
        crc, seen = 0, 0
        with os.fdopen(os.dup(fd), "rb") as f:
            while block := f.read(_READ_BLOCK):  # streamed: a chunk may be large
                crc = _crcs.extend_crc(crc, block)
                seen += len(block)
        if seen != size or crc != _CRC32C_RESIDUE:
            raise Refused(f"{shown}: its crc32c does not match its bytes (damaged or changed)")
        stored = int.from_bytes(os.pread(fd, CRC_BYTES, size - CRC_BYTES), "little")
        if stored != expected:
            raise Refused(not_the_snapshot(shown, stored, expected))
    finally:
        os.close(fd)
