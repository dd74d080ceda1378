"""Format version 1's writer: one zarr3 chunk file per chunk (a batch shard per file) under a
local directory, its first pages written with ``O_DIRECT`` where the filesystem allows.
One writer per save, driven by the save's background thread; its futures are completed
by the writer's own threads.

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
    direct_span,
)


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
        """Writes the page-aligned head of ``first`` with ``O_DIRECT`` (no copy into the
        page cache: a tenth of a buffered write's system time); returns the bytes written,
        the file left buffered for the rest. A filesystem refusing it turns it off here."""
        skip, head = direct_span(first)  # its whole pages, when it starts on a page
        if skip or not head:
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
