"""Writing zarr3 chunk files straight from host memory on a local disk.

:class:`ChunkWriter` writes whole chunks of arrays and whole batch arrays (the
``sharding_indexed`` codec) byte for byte as tensorstore writes them for the specs of
``_arrays``; :class:`Gathered` is a batch given as its leaves' own buffers. Why, and
what it measured: docs/chunk_files.md. A chunk's page-aligned payload is written with
``O_DIRECT`` (no copy into the page cache), the rest buffered: docs/saving.md. The
writer's threads can run at a lower CPU priority (opt-in: ``_base.env``): they
only checksum and write local files (a subclass whose tasks call a store's client
passes ``local_only=False``).

Threading and call order: one :class:`ChunkWriter` per save, used by the save's
background thread only; its :meth:`~ChunkWriter.array`/:meth:`~ChunkWriter.batch`
return futures completed by the writer's own threads, each holding a reference to the
bytes it writes until it is done. Files are created with ``O_EXCL | O_NOFOLLOW`` inside
the save's fresh staging directory: nothing existing is overwritten or followed.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import fcntl
import os
import sys

import numpy as np

from .._base import env as _env
from .._base import host as _host
from .._storage.location import check_name
from . import chunks as _chunks

_SYNC_FILE_RANGE_WRITE = 2
DIRECT_ALIGN = 4096  # address, length and file offset of an O_DIRECT write
O_DIRECT = getattr(os, "O_DIRECT", 0)


def direct_io_enabled() -> bool:
    """Whether chunk payloads may be written with ``O_DIRECT`` (``FOP_DIRECT_IO=0``
    turns it off; so does a filesystem that refuses it, found at the first file)."""
    return bool(O_DIRECT) and _env.read("FOP_DIRECT_IO") != "0"


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def direct_span(first: np.ndarray, minimum: int = DIRECT_ALIGN) -> tuple[int, int]:
    """(skip, length): the bytes of ``first`` an ``O_DIRECT`` write can take wherever it
    starts in memory: ``length`` bytes of whole pages from its first page boundary,
    ``skip`` bytes in (0, 0: none; it must be C-contiguous and leave at least
    ``minimum`` such bytes). Written at a file offset congruent to its address modulo
    :data:`DIRECT_ALIGN`, the part after ``skip`` lands on page boundaries both in
    memory and in the file: a zero-copy view of a jax buffer (which jax places a few
    cache lines past a page) is then written directly, its first ``skip`` bytes and
    its tail buffered."""
    if not first.flags.c_contiguous:
        return 0, 0
    skip = -first.ctypes.data % DIRECT_ALIGN
    body = first.nbytes - skip
    length = body - body % DIRECT_ALIGN
    return (skip, length) if length >= max(minimum, 1) else (0, 0)


def direct_head(first: np.ndarray, minimum: int = DIRECT_ALIGN) -> int:
    """The bytes of ``first`` (a file's or segment's first piece) an ``O_DIRECT`` write
    can take: its whole pages, when it is C-contiguous, starts on a page and is at
    least ``minimum`` bytes (0: none)."""
    if first.nbytes < minimum or not first.flags.c_contiguous:
        return 0
    if first.ctypes.data % DIRECT_ALIGN:
        return 0
    return first.nbytes - first.nbytes % DIRECT_ALIGN


class ChunkWriter:
    """Writes whole zarr3 chunks of arrays under ``root`` (a local directory path)."""

    def __init__(self, root: str, *, threads: int = _chunks.THREADS, local_only: bool = True):
        self._root = root
        self._direct = direct_io_enabled()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads,
            thread_name_prefix="fop-chunk",
            initializer=_env.initializer(local_only=local_only),
        )
        self._dirs: set[str] = set()

    def close(self) -> None:
        """Waits for every submitted write (their errors are raised by their futures)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- arrays ------------------------------------------------------------------------

    def array(
        self,
        sub: str,
        shape: tuple[int, ...],
        chunk: tuple[int, ...],
        index: tuple[slice, ...],
        data: np.ndarray,
        crcs: dict | None = None,
    ) -> list[concurrent.futures.Future] | None:
        """Starts writing every chunk of the region ``index`` (global) of the array
        ``sub`` from ``data`` (that region's values); None, writing nothing, when the
        region does not consist of whole chunks (chunks cut by the array's end are
        whole: they are padded with zeros, the fill value, as tensorstore pads them).
        ``crcs``: ``{chunk grid cell: crc32c}`` of chunks of ``data`` checksummed
        already (as they were copied: ``chunks.copy_with_crcs``); a chunk there is not
        read again to checksum it, the others are checksummed here."""
        region = _chunks.whole_chunks(shape, chunk, index)
        if region is None or data.shape != region[0]:
            return None
        return [
            self._pool.submit(
                self._write_chunk,
                f"{sub}/{_chunks.chunk_key(cell)}",
                data[at],
                tuple(chunk),
                None if crcs is None else crcs.get(cell),
            )
            for cell, at in region[1]
        ]

    def _write_chunk(
        self, name: str, view: np.ndarray, chunk: tuple[int, ...], crc: int | None
    ) -> None:
        payload = _chunks.chunk_payload(view, chunk)
        if crc is None:
            trailer = _chunks.crc_trailer([payload])
        else:
            trailer = np.frombuffer(crc.to_bytes(_chunks.CRC_BYTES, "little"), np.uint8)
        self._write_file(name, [payload, trailer])

    # -- batches (sharding_indexed) -----------------------------------------------------

    def batch(
        self, sub: str, chunk: int, inner: int, data: np.ndarray | Gathered
    ) -> list[concurrent.futures.Future]:
        """Starts writing the whole batch array ``sub`` (1-D) from ``data`` (its values,
        or its leaves as :class:`Gathered` pieces): one file per ``chunk`` elements, each
        a zarr3 shard of checksummed ``inner``-element chunks followed by its checksummed
        index."""
        if isinstance(data, np.ndarray):
            data = Gathered([(0, data)], data.dtype, data.size)
        size, itemsize = data.size, data.dtype.itemsize
        return [
            self._pool.submit(
                self._write_shard,
                f"{sub}/{_chunks.chunk_key((s,))}",
                data,
                s,
                size * itemsize,
                chunk * itemsize,
                inner * itemsize,
            )
            for s in range(-(-size // chunk))
        ]

    def _write_shard(
        self, name: str, data: Gathered, s: int, size: int, chunk: int, inner: int
    ) -> None:
        """Sizes in bytes. Inner chunks past ``size`` are not stored (index: missing)."""
        pieces: list[np.ndarray] = []
        entries = np.full(2 * (chunk // inner), _chunks.MISSING_ENTRY, dtype="<u8")
        offset = 0
        for j in range(chunk // inner):
            start = s * chunk + j * inner
            if start >= size:
                break
            segments = data.segments(start, start + inner, size)
            pieces += segments + [_chunks.crc_trailer(segments)]
            entries[2 * j] = offset
            entries[2 * j + 1] = inner + _chunks.CRC_BYTES
            offset += inner + _chunks.CRC_BYTES
        index = _chunks.as_bytes(entries)
        pieces += [index, _chunks.crc_trailer([index])]
        self._write_file(name, pieces)

    # -- files ---------------------------------------------------------------------------

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


_ZEROS = np.zeros(1 << 17, np.uint8)
_ZEROS.flags.writeable = False


def _zeros(nbytes: int) -> np.ndarray:
    return _ZEROS[:nbytes] if nbytes <= _ZEROS.size else np.zeros(nbytes, np.uint8)


class Gathered:
    """A 1-D array's bytes given as pieces at byte offsets, zeros between and after
    them: a batch of small leaves written straight from the leaves' own (snapshot)
    buffers, never copied into one batch buffer first.

    ``pieces``: (byte offset, C-contiguous array), non-overlapping, any order; ``dtype``
    and ``size`` (elements): the array's.
    """

    def __init__(self, pieces: list[tuple[int, np.ndarray]], dtype, size: int):
        ordered = sorted(((int(o), _chunks.as_bytes(a)) for o, a in pieces), key=lambda p: p[0])
        self._offsets = [o for o, _ in ordered]
        self._pieces = [a for _, a in ordered]
        self.dtype = np.dtype(dtype)
        self.size = int(size)
        self.nbytes = self.size * self.dtype.itemsize

    def segments(self, start: int, stop: int, size: int) -> list[np.ndarray]:
        """Read-only uint8 arrays that together are bytes ``[start, stop)`` (zeros where
        no piece is, and past ``size``)."""
        out: list[np.ndarray] = []
        at = start
        i = max(0, bisect.bisect_right(self._offsets, start) - 1)
        end = min(stop, size)
        while at < end and i < len(self._pieces):
            lo, piece = self._offsets[i], self._pieces[i]
            hi = lo + piece.size
            if hi <= at:
                i += 1
                continue
            if lo >= end:
                break
            if lo > at:
                out.append(_zeros(lo - at))
                at = lo
            take = min(hi, end)
            out.append(piece[at - lo : take - lo])
            at = take
            i += 1
        if at < stop:
            out.append(_zeros(stop - at))
        return out

    def assemble(self) -> np.ndarray:
        """The whole array in one aligned buffer (for tensorstore's writes)."""
        out = _host.empty((self.size,), self.dtype)
        flat = out.view(np.uint8)
        at = 0
        for lo, piece in zip(self._offsets, self._pieces, strict=True):
            flat[at:lo] = 0
            flat[lo : lo + piece.size] = piece
            at = lo + piece.size
        flat[at:] = 0
        return out
