"""Format version 1's writer: one zarr3 chunk file per chunk (a batch shard per file) under a
local directory, its first page written with ``O_DIRECT`` where the filesystem allows.

Only a save of format version 1 runs this (``format_version=1``); version 2 writes data
files (``packed_writer.PackedWriter``). One writer per save, driven by the save's
background thread only; its futures are completed by the writer's own threads.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.packed_writer``.
"""

from __future__ import annotations

import fcntl
import os

import numpy as np

from .._storage.location import check_name
from . import chunks as _chunks
from .packed_writer import (
    _SYNC_FILE_RANGE_WRITE,
    DIRECT_ALIGN,
    O_DIRECT,
    ChunkWriter,
    _sync_file_range,
)


def direct_head(first: np.ndarray, minimum: int = DIRECT_ALIGN) -> int:
    """The bytes of ``first`` (a file's or segment's first piece) an ``O_DIRECT`` write
    can take: its whole pages, when it is C-contiguous, starts on a page and is at
    least ``minimum`` bytes (0: none)."""
    if first.nbytes < minimum or not first.flags.c_contiguous:
        return 0
    if first.ctypes.data % DIRECT_ALIGN:
        return 0
    return first.nbytes - first.nbytes % DIRECT_ALIGN


class ChunkFileWriter(ChunkWriter):
    """Writes whole zarr3 chunks of arrays under ``root`` (a local directory path), each
    chunk (or batch shard) a file of its own."""

    def _write_file(self, name: str, pieces: list[np.ndarray]) -> None:
        path = os.path.join(self._root, check_name(name))
        parent = os.path.dirname(path)
        if parent not in self._dirs:
            os.makedirs(parent, exist_ok=True)
            self._dirs.add(parent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o644)
        try:
            views = [memoryview(p) for p in pieces if p.size]
            offset = self._write_direct(fd, pieces[0]) if self._direct and pieces else 0
            if offset:
                _chunks.advance(views, offset)
                os.lseek(fd, offset, os.SEEK_SET)
            while views:
                _chunks.advance(views, os.writev(fd, views[: _chunks.IOV_MAX]))
            if _sync_file_range is not None:  # start writeback now; never waits for it
                _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, first: np.ndarray) -> int:
        """Writes the page-aligned head of ``first`` (the file's first piece) with
        ``O_DIRECT``, from its own memory to the disk: no copy into the page cache, the
        CPU time the training steps would lose (measured: a tenth of the system time of
        a buffered write). Returns the bytes written (0: nothing was, the caller writes
        it all); the file is left in buffered mode for the rest. A filesystem that
        refuses ``O_DIRECT`` turns it off for this writer."""
        head = direct_head(first)
        if head == 0:
            return 0
        mode = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, mode | O_DIRECT)
        except OSError:
            self._direct = False
            return 0
        view = memoryview(first.reshape(-1).view(np.uint8))[:head]
        done = 0
        try:
            while done < head:
                done += os.pwrite(fd, view[done:], done)
        except OSError:  # the caller writes the rest buffered (and reports a real error)
            if not done:
                self._direct = False
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, mode)
        return done - done % DIRECT_ALIGN if done < head else done
