"""zarr3 chunk files written and read straight from host memory on a local disk.

The files are byte for byte those tensorstore writes for the specs of ``_arrays``
(``bytes`` little-endian then ``crc32c``; for batches, the ``sharding_indexed`` codec
with its index at the end), so tensorstore, and any zarr3 reader, reads them. Measured
reasons (1.2 GB of 4 MiB chunks on a 2-core machine):

* writes without a chunk-buffer copy: a whole, contiguous chunk goes from the
  snapshot to the kernel in one ``writev`` with its checksum (crc32c at ~13 GB/s),
  about 0.25 s of CPU less per GB than tensorstore's encode;
* writeback starts as each file is written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
  which does not wait), so the disk works while later chunks are copied and the final
  ``syncfs`` finds little left: a durable save took 0.41-0.59 s against 0.87-1.16 s;
* reads of whole arrays and batches go straight into the result with one ``preadv``
  per file (tensorstore reads each chunk into a fresh buffer and copies it): 1.2 GB
  with a warm page cache in 0.47-0.55 s against 0.82-0.88 s.

Anything else (object stores, compression, a big-endian host, a region that is not
whole chunks, a read of part of an array) goes through tensorstore: :func:`usable`,
:meth:`ChunkWriter.array` and :meth:`ChunkReader.read` say so.

Threading and call order: one :class:`ChunkWriter` per save, used by the save's
background thread only; its :meth:`~ChunkWriter.array`/:meth:`~ChunkWriter.batch`
return futures completed by the writer's own threads, each holding a reference to the
bytes it writes until it is done. Files are created with ``O_EXCL | O_NOFOLLOW`` inside
the save's fresh staging directory: nothing existing is overwritten or followed. One
:class:`ChunkReader` per restore likewise (see its docstring).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import errno
import itertools
import math
import os
import stat
import sys
import threading
from typing import Any

import google_crc32c
import numpy as np

from .._base import faults as _faults
from .._base import host as _host
from .._storage.location import check_name, walk_entries

THREADS = 8  # as tensorstore's file_io_concurrency for local disks (_storage.context)
_IOV_MAX = 1000  # below the kernel's 1024 buffers per writev
_MISSING = (1 << 64) - 1  # a shard index entry for an inner chunk that is not stored

_SYNC_FILE_RANGE_WRITE = 2


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


def usable(location: Any) -> bool:
    """Whether arrays under ``location`` can be written here (those without a
    compression codec: the caller checks each)."""
    return (
        location.is_local
        and sys.byteorder == "little"
        and hasattr(os, "preadv")  # POSIX scatter/gather I/O (not on Windows)
        and hasattr(os, "writev")
    )


def _whole_chunks(shape, chunk, index):
    """For the region ``index`` (global) of an array of ``shape``: (the region's shape,
    [(chunk grid cell, the cell's part of the region, relative to it), ...]); None when
    the region is empty or not whole chunks (a chunk cut by the array's end counts as
    whole)."""
    if not shape:
        return None
    starts, stops = [], []
    for s, n, c in zip(index, shape, chunk, strict=True):
        start, stop, step = s.indices(n)
        if step != 1 or start >= stop or start % c or (stop % c and stop != n):
            return None
        starts.append(start)
        stops.append(stop)
    cells = []
    ranges = [range(a // c, -(-b // c)) for a, b, c in zip(starts, stops, chunk, strict=True)]
    for cell in itertools.product(*ranges):
        at = []
        for i, c, n, start in zip(cell, chunk, shape, starts, strict=True):
            at.append(slice(i * c - start, min(i * c + c, n) - start))
        cells.append((cell, tuple(at)))
    return tuple(b - a for a, b in zip(starts, stops, strict=True)), cells


def _crc(parts: list[np.ndarray]) -> np.ndarray:
    """The zarr3 ``crc32c`` codec's trailer of the bytes of ``parts`` one after another
    (C-contiguous arrays), as 4 uint8."""
    crc = 0
    for part in parts:
        crc = google_crc32c.extend(crc, _as_bytes(part))
    return np.frombuffer(crc.to_bytes(4, "little"), np.uint8)


def _chunk_payload(view: np.ndarray, chunk: tuple[int, ...]) -> np.ndarray:
    """The stored bytes of one chunk (before its crc32c) from ``view``, the chunk's
    part of the array: zero-padded to the full ``chunk`` where the array's end cuts
    it, as tensorstore pads it."""
    if view.shape != chunk:  # cut by the array's end: zero-padded to the full chunk
        full = np.zeros(chunk, view.dtype)
        full[tuple(slice(0, n) for n in view.shape)] = view
        view = full
    elif not view.flags.c_contiguous:
        view = np.ascontiguousarray(view)
    return _as_bytes(view)


def chunk_crcs(
    shape: tuple[int, ...], chunk: tuple[int, ...], index: tuple[slice, ...], data: np.ndarray
) -> dict[tuple[int, ...], int] | None:
    """``{chunk grid cell: crc32c}`` of every chunk of the region ``index`` (global) of
    an array of ``shape`` holding ``data`` (that region's values): the value the
    zarr3 ``crc32c`` codec stores as the trailer of each chunk file that
    :meth:`ChunkWriter.array` (or tensorstore) writes for it, computed over the same
    bytes (little endian, edge chunks zero-padded). None when the region is not whole
    chunks. A 0-d array is one chunk, cell ``()``. Any thread; reads ``data`` only."""
    if data.dtype.byteorder == ">":  # the stored encoding is little endian
        data = data.astype(data.dtype.newbyteorder("<"))
    if not shape:
        if data.shape != ():
            return None
        return {
            (): int.from_bytes(_crc([_as_bytes(np.ascontiguousarray(data))]).tobytes(), "little")
        }
    region = _whole_chunks(shape, chunk, index)
    if region is None or data.shape != region[0]:
        return None
    return {
        cell: int.from_bytes(_crc([_chunk_payload(data[at], tuple(chunk))]).tobytes(), "little")
        for cell, at in region[1]
    }


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat, read-only uint8 view (any dtype,
    ml_dtypes ones too; google_crc32c takes read-only buffers only)."""
    out = array.reshape(-1).view(np.uint8)
    out.flags.writeable = False
    return out


# -- what the files of an array must hold (checked before anything is allocated) ------

# A zstd frame decodes to at most ~26,000x its size (every 128 KiB block needs at
# least ~5 bytes); a bound above that, for claims about compressed chunk files.
MAX_COMPRESSION_RATIO = 1 << 16


def array_claim(shape, chunk, itemsize: int, *, compressed: bool) -> tuple[int, int]:
    """(chunk files, bytes) that an array of ``shape`` stored in ``chunk``-shaped chunks
    needs on disk: uncompressed, each file is the whole (padded) chunk and its crc32c;
    compressed, the bytes are a lower bound (see :data:`MAX_COMPRESSION_RATIO`).
    Python ints: claims of any size are computed exactly, nothing is allocated."""
    cells = math.prod(-(-int(n) // int(c)) for n, c in zip(shape, chunk, strict=True))
    chunk_bytes = math.prod(int(c) for c in chunk) * itemsize
    if compressed:
        return cells, -(-math.prod(shape) * itemsize // MAX_COMPRESSION_RATIO)
    return cells, cells * (chunk_bytes + 4)


def batch_claim(
    size: int, chunk: int, inner: int, itemsize: int, *, compressed: bool
) -> tuple[int, int]:
    """(files, bytes) that a batch array (1-D, ``size`` elements, files of ``chunk``
    elements holding ``inner``-element chunks, as ``ChunkWriter.batch`` and tensorstore
    write it) needs on disk; compressed, a lower bound."""
    files = -(-size // chunk)
    index = files * (16 * (chunk // inner) + 4)  # one checksummed index per file
    if compressed:
        return files, index + -(-size * itemsize // MAX_COMPRESSION_RATIO)
    last = size - (files - 1) * chunk
    inners = (files - 1) * (chunk // inner) + -(-last // inner)
    return files, index + inners * (inner * itemsize + 4)


def stored_files(root: str, sub: str) -> tuple[int, int]:
    """(regular files, their total bytes) under ``root/sub/c`` (an array's chunk files),
    walked without following any link; (0, 0) when there is no such directory. Costs
    one ``stat`` per file that exists, whatever the metadata claims."""
    count = total = 0
    for entry in walk_entries(os.path.join(root, check_name(sub), "c")):
        if entry.is_file(follow_symlinks=False):
            count += 1
            total += entry.stat(follow_symlinks=False).st_size
    return count, total


class ChunkWriter:
    """Writes whole zarr3 chunks of arrays under ``root`` (a local directory path)."""

    def __init__(self, root: str, *, threads: int = THREADS):
        self._root = root
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fop-chunk")
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
    ) -> list[concurrent.futures.Future] | None:
        """Starts writing every chunk of the region ``index`` (global) of the array
        ``sub`` from ``data`` (that region's values); None, writing nothing, when the
        region does not consist of whole chunks (chunks cut by the array's end are
        whole: they are padded with zeros, the fill value, as tensorstore pads them)."""
        region = _whole_chunks(shape, chunk, index)
        if region is None or data.shape != region[0]:
            return None
        return [
            self._pool.submit(
                self._write_chunk, f"{sub}/c/" + "/".join(map(str, cell)), data[at], tuple(chunk)
            )
            for cell, at in region[1]
        ]

    def _write_chunk(self, name: str, view: np.ndarray, chunk: tuple[int, ...]) -> None:
        payload = _chunk_payload(view, chunk)
        self._write_file(name, [payload, _crc([payload])])

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
                f"{sub}/c/{s}",
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
        entries = np.full(2 * (chunk // inner), _MISSING, dtype="<u8")
        offset = 0
        for j in range(chunk // inner):
            start = s * chunk + j * inner
            if start >= size:
                break
            segments = data.segments(start, start + inner, size)
            pieces += segments + [_crc(segments)]
            entries[2 * j] = offset
            entries[2 * j + 1] = inner + 4
            offset += inner + 4
        index = _as_bytes(entries)
        pieces += [index, _crc([index])]
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
            while views:
                _advance(views, os.writev(fd, views[:_IOV_MAX]))
            if _sync_file_range is not None:  # start writeback now; never waits for it
                _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
        finally:
            os.close(fd)


class ChunkReader:
    """Reads whole arrays and batches stored without compression from local chunk files
    straight into fresh aligned host buffers: one ``preadv`` per file, each chunk
    into its place in the result.

    Every chunk file must be a regular file (``O_NOFOLLOW``) of exactly the chunk's
    size plus its checksum, and the crc32c must match; otherwise the read raises
    ValueError naming the chunk (the caller names the leaf).

    Threading: :meth:`read` and :meth:`read_batch` are called from one thread (the
    restore's); the reads run on the reader's threads; :meth:`close` waits for them.
    """

    def __init__(self, root: str, *, threads: int = THREADS):
        self._root = root
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fop-read")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def read(
        self,
        sub: str,
        shape: tuple[int, ...],
        chunk: tuple[int, ...],
        dtype,
        region: tuple[slice, ...] | None = None,
    ) -> PendingRead | None:
        """Starts reading ``region`` (global; None: all) of array ``sub``; None when the
        region is not whole chunks (chunks cut by the array's end count as whole), so
        tensorstore reads it instead.

        A chunk whose bytes are contiguous in the result (it spans the region's every
        axis but the first) is read straight into place; any other is read whole into
        a scratch buffer, checked, then copied into place."""
        check_name(sub)  # never a path outside the checkpoint
        whole = _whole_chunks(shape, chunk, region or tuple(slice(None) for _ in shape))
        if whole is None:
            return None
        read = PendingRead(whole[0], dtype)
        chunk_bytes = int(np.prod(chunk, dtype=np.int64)) * read.out.dtype.itemsize
        for cell, at in whole[1]:
            dest = read.out[at]
            path = os.path.join(self._root, sub, "c", *map(str, cell))
            if dest.flags.c_contiguous and dest.shape[1:] == tuple(chunk[1:]):
                # in place; a chunk cut along the first axis only has its padding last
                job = (_read_chunk, path, _as_writable_bytes(dest), chunk_bytes)
            else:
                job = (_read_chunk_copy, path, dest, tuple(chunk))
            read.futures.append(self._pool.submit(*job))
        return read

    def read_batch(
        self, sub: str, size: int, chunk: int, inner: int, dtype, files: range | None = None
    ) -> PendingRead:
        """Starts reading all of batch array ``sub`` (1-D, ``size`` elements, files of
        ``chunk`` elements holding ``inner``-element chunks), or only the elements of
        its ``files`` (consecutive file numbers: ``verify`` reads a batch a few files at
        a time)."""
        check_name(sub)  # never a path outside the checkpoint
        files = range(-(-size // chunk)) if files is None else files
        first = files.start * chunk if files else 0
        stop = min(size, files.stop * chunk) if files else 0
        read = PendingRead((stop - first,), dtype)
        flat = read.out.view(np.uint8)
        itemsize = read.out.dtype.itemsize
        read.futures = [
            self._pool.submit(
                _read_shard,
                os.path.join(self._root, sub, "c", str(s)),
                flat,
                s,
                size * itemsize,
                chunk * itemsize,
                inner * itemsize,
                first * itemsize,
            )
            for s in files
        ]
        return read


class PendingRead:
    """One array being read by a :class:`ChunkReader`; :meth:`result` is its values."""

    def __init__(self, shape, dtype):
        self.out = _host.empty(tuple(shape), dtype)  # adopted by jax on CPU without a copy
        self.futures: list[concurrent.futures.Future] = []

    def result(self) -> np.ndarray:
        for future in self.futures:
            future.result()
        return self.out


_read_lock = threading.Lock()
_read_total = 0


def bytes_read() -> int:
    """Bytes this process has read from chunk files through :class:`ChunkReader` (a
    counter, as tensorstore's ``/tensorstore/kvstore/file/bytes_read`` metric is for
    its own reads)."""
    with _read_lock:
        return _read_total


def _read_chunk(path: str, dest: np.ndarray, chunk_bytes: int) -> None:
    """Reads one chunk file: its first ``dest.size`` bytes into ``dest``, the zero
    padding of a chunk cut by the array's end into scratch, then checks its crc32c."""
    name = _name(path)
    parts = [dest]
    if chunk_bytes > dest.size:
        parts.append(np.empty(chunk_bytes - dest.size, np.uint8))
    trailer = np.empty(4, np.uint8)
    _read_file(path, name, parts + [trailer])
    if not _crc_matches(parts, trailer):
        raise ValueError(f"chunk {name}: crc32c checksum mismatch")


_scratch = threading.local()  # per reader thread: one chunk's bytes, reused


def _read_chunk_copy(path: str, dest: np.ndarray, chunk: tuple[int, ...]) -> None:
    """Reads one chunk file whole into scratch, checks it, then copies the part that
    lies in the array (``dest``'s shape, from the chunk's origin) into ``dest``.

    The scratch is the thread's own, kept between chunks: fresh memory for every
    chunk would cost its first touch each time (about 0.6 s per GB on this machine)."""
    nbytes = int(np.prod(chunk, dtype=np.int64)) * dest.dtype.itemsize
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < nbytes:
        buffer = _scratch.buffer = np.empty(nbytes, np.uint8)
    raw = buffer[:nbytes]
    _read_chunk(path, raw, nbytes)
    dest[...] = raw.view(dest.dtype).reshape(chunk)[tuple(slice(0, n) for n in dest.shape)]


def _as_writable_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat uint8 view to read into."""
    return array.reshape(-1).view(np.uint8)


def _read_shard(
    path: str, flat: np.ndarray, s: int, size: int, chunk: int, inner: int, base: int = 0
) -> None:
    """Reads one batch file (a zarr3 shard, sizes in bytes) into ``flat`` (the batch's
    bytes from byte ``base`` on): every stored inner chunk straight to its place, then
    checks the index (exactly the layout both writers produce: inner chunks in order,
    none missing before ``size``) and every checksum."""
    name = _name(path)
    count = chunk // inner
    present = -(-min(size - s * chunk, chunk) // inner)
    parts: list[np.ndarray] = []
    checks: list[tuple[list[np.ndarray], np.ndarray]] = []
    for j in range(present):
        start = s * chunk + j * inner
        data = [flat[start - base : min(start + inner, size) - base]]
        if data[0].size < inner:
            data.append(np.empty(inner - data[0].size, np.uint8))
        trailer = np.empty(4, np.uint8)
        parts += data + [trailer]
        checks.append((data, trailer))
    index = np.empty(2 * count, "<u8")
    index_trailer = np.empty(4, np.uint8)
    _read_file(path, name, parts + [index.view(np.uint8), index_trailer])
    if not _crc_matches([index.view(np.uint8)], index_trailer):
        raise ValueError(f"batch file {name}: crc32c checksum mismatch in its index")
    expected = np.full(2 * count, _MISSING, "<u8")
    expected[0 : 2 * present : 2] = np.arange(present, dtype="<u8") * (inner + 4)
    expected[1 : 2 * present : 2] = inner + 4
    if not np.array_equal(index, expected):
        raise ValueError(f"batch file {name}: its index does not list the expected chunks")
    for j, (data, trailer) in enumerate(checks):
        if not _crc_matches(data, trailer):
            raise ValueError(f"batch file {name}: crc32c checksum mismatch in inner chunk {j}")


def _name(path: str) -> str:
    return "/".join(path.split(os.sep)[-4:])


def _crc_matches(parts: list[np.ndarray], trailer: np.ndarray) -> bool:
    return np.array_equal(_crc(parts), trailer)


def _read_file(path: str, name: str, parts: list[np.ndarray]) -> None:
    """Fills ``parts`` (uint8 arrays) with the whole file at ``path``, which must be a
    regular file of exactly their total size (never followed if a symlink)."""
    global _read_total
    expected = sum(p.size for p in parts)
    _faults.fail_point("read_chunk")
    try:
        # O_NONBLOCK: a FIFO in the checkpoint's place never blocks (refused below)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        # Damage only where proven: the file is absent, a symlink or under a file.
        # Anything else (EMFILE, EIO, EACCES, ENOMEM...) is the environment's: raised.
        if e.errno == errno.ENOENT:
            raise ValueError(f"chunk {name} is missing") from None
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(f"chunk {name} cannot be opened: {e}") from None
        raise
    at = 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != expected:
            raise ValueError(
                f"chunk {name}: expected a file of {expected} bytes, found {st.st_size}"
            )
        views = [memoryview(p) for p in parts if p.size]
        while views:
            got = os.preadv(fd, views[:_IOV_MAX], at)
            if got == 0:
                raise ValueError(f"chunk {name}: ended early")
            at += got
            _advance(views, got)
    finally:
        os.close(fd)
        with _read_lock:
            _read_total += at


def _advance(views: list[memoryview], done: int) -> None:
    """Drops ``done`` bytes from the front of ``views`` (a short read or write resumes
    mid-buffer)."""
    while done:
        if done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][done:]
            done = 0


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
        ordered = sorted(((int(o), _as_bytes(a)) for o, a in pieces), key=lambda p: p[0])
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
