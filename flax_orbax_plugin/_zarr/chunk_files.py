"""zarr3 chunk files read straight into host memory on a local disk, and what they must hold.

One ``ChunkReader`` per restore; the shared reader threads start once per process (any
thread), forgotten in a forked child.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.chunk_files``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import math
import os
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .._base import env as _env
from .._base import host as _host
from .._storage.location import check_name, walk_entries
from . import chunks as _chunks
from .chunks import crc_trailer


def file_name(path: str) -> str:
    """A version-1 chunk or batch file's name in errors (its last 4 parts)."""
    return "/".join(path.split(os.sep)[-4:])


def stored_name(path: str, where: Callable[[str], str] | None, kind: str) -> str:
    """Chunk ``path``'s bytes in a damage error: ``where(path)`` (version 2), else its file."""
    return where(path) if where is not None else f"{kind} {file_name(path)}"


def crc_matches(parts: list[np.ndarray], trailer: np.ndarray) -> bool:
    return np.array_equal(crc_trailer(parts), trailer)


class Jobs:
    """This reader's jobs on the process's shared pool of reader threads (started once)."""

    def __init__(self, threads: int):
        self._pool = _shared_pool(threads)
        self._futures: list[concurrent.futures.Future] = []

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = self._pool.submit(fn, *args, **kwargs)
        self._futures.append(future)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        futures, self._futures = self._futures, []
        if cancel_futures:
            for future in futures:
                future.cancel()
        if wait:
            concurrent.futures.wait(futures)


_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _shared_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix="fop-read"
            )
        return pool


def _forget_pools() -> None:
    """In a forked child: the parent's reader threads do not exist there."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


PREFETCH_BYTES = 256 << 20  # read ahead: about a disk's reading while large metadata parses


def prefetch_batches(root: str, threads: int) -> concurrent.futures.Future | None:
    """Asks the kernel to start reading the batch files under ``root/b`` (None: no hint)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    return _shared_pool(threads).submit(_advise_batches, os.path.join(root, "b"))


def _advise_batches(top: str) -> None:
    try:
        batches = [e for e in os.scandir(top) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    budget = PREFETCH_BYTES
    for batch in sorted(batches, key=lambda e: e.name):
        try:
            files = [e for e in os.scandir(os.path.join(batch.path, "c"))]
        except OSError:
            continue
        for entry in sorted(files, key=lambda e: (len(e.name), e.name)):  # 0, 1, ..., 10
            if entry.is_file(follow_symlinks=False) and budget > 0:
                budget -= entry.stat(follow_symlinks=False).st_size
                _advise(entry.path)


def _advise(path: str) -> None:
    with contextlib.suppress(OSError):  # a hint: a failure is the later read's to report
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def usable(location: Any) -> bool:
    """Whether uncompressed arrays under ``location`` can be written here."""
    return (
        location.is_local
        and sys.byteorder == "little"
        and hasattr(os, "preadv")  # POSIX scatter/gather I/O (not on Windows)
        and hasattr(os, "writev")
    )


# A zstd frame decodes to at most ~26,000x its size (every 128 KiB block needs at
# least ~5 bytes); a bound above that, for claims about compressed chunk files.
MAX_COMPRESSION_RATIO = 1 << 16


def array_claim(shape, chunk, itemsize: int, *, compressed: bool) -> tuple[int, int]:
    """(chunk files, bytes) an array needs on disk (compressed: a lower bound)."""
    cells = math.prod(-(-int(n) // int(c)) for n, c in zip(shape, chunk, strict=True))
    chunk_bytes = math.prod(int(c) for c in chunk) * itemsize
    if compressed:
        return cells, -(-math.prod(shape) * itemsize // MAX_COMPRESSION_RATIO)
    return cells, cells * (chunk_bytes + _chunks.CRC_BYTES)


def batch_claim(
    size: int, chunk: int, inner: int, itemsize: int, *, compressed: bool
) -> tuple[int, int]:
    """(files, bytes) a batch array needs on disk (compressed: a lower bound)."""
    files = -(-size // chunk)
    index = files * (16 * (chunk // inner) + _chunks.CRC_BYTES)  # one checksummed index per file
    if compressed:
        return files, index + -(-size * itemsize // MAX_COMPRESSION_RATIO)
    last = size - (files - 1) * chunk
    inners = (files - 1) * (chunk // inner) + -(-last // inner)
    return files, index + inners * (inner * itemsize + _chunks.CRC_BYTES)


def stored_files(root: str, sub: str) -> tuple[int, int]:
    """(regular files, bytes) under ``root/sub/c``, following no link; (0, 0) if absent."""
    count = total = 0
    for entry in walk_entries(os.path.join(root, check_name(sub), _chunks.CHUNK_DIR)):
        if entry.is_file(follow_symlinks=False):
            count += 1
            total += entry.stat(follow_symlinks=False).st_size
    return count, total


BATCH_THREADS = 4  # threads of ranged batch reads (read_batch_range)


class ChunkReader:
    """Reads uncompressed arrays and batches from local chunk files straight into fresh
    aligned host buffers, each chunk checked (else ValueError naming it). Called from the
    restore's thread; the reads run on the reader's threads; :meth:`close` waits for them."""

    packed = False  # format version 2's reader (a subclass) reads every array and batch

    def __init__(self, root: str, *, threads: int = _chunks.THREADS):
        self._root = root
        self._pool = Jobs(threads)
        self._scratch: dict[int, np.ndarray] = {}  # _read_chunk_copy's; freed with the reader
        # Ranged batch reads, in file order on fewer threads: the first files are done
        # early, so their leaves are placed while the rest are read (8 threads at once
        # finished the first of 12 batch files after most of the reading).
        self._batch_pool = Jobs(min(threads, BATCH_THREADS))
        self._fill = _read_file  # (path, name, parts): a subclass reads from elsewhere
        self._ranged = _read_ranges  # (path, name, expected, ranges); None: no parts read
        self._where = None  # (path) -> where a subclass stores a chunk (stored_name)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._batch_pool.shutdown(wait=True, cancel_futures=True)

    def _fill_kw(self) -> dict:
        return {} if self._fill is _read_file else {"fill": self._fill, "where": self._where}

    def read(
        self,
        sub: str,
        shape: tuple[int, ...],
        chunk: tuple[int, ...],
        dtype,
        region: tuple[slice, ...] | None = None,
    ) -> PendingRead | None:
        """Starts reading ``region`` (global; None: all) of array ``sub``; None when the
        region is not whole chunks."""
        check_name(sub)  # never a path outside the checkpoint
        whole = _chunks.whole_chunks(shape, chunk, region or tuple(slice(None) for _ in shape))
        if whole is None:
            return None
        read = PendingRead(whole[0], dtype)
        chunk_bytes = int(np.prod(chunk, dtype=np.int64)) * read.out.dtype.itemsize
        for cell, at in whole[1]:
            dest = read.out[at]
            path = os.path.join(self._root, sub, *_chunks.chunk_parts(cell))
            if dest.flags.c_contiguous and dest.shape[1:] == tuple(chunk[1:]):
                # in place; a chunk cut along the first axis only has its padding last
                job = (_read_chunk, path, dest.reshape(-1).view(np.uint8), chunk_bytes)
            else:
                job = (_read_chunk_copy, path, dest, tuple(chunk), self._scratch)
            read.futures.append(self._pool.submit(*job, **self._fill_kw()))
        return read

    def read_batch(
        self, sub: str, size: int, chunk: int, inner: int, dtype, files: range | None = None
    ) -> PendingRead:
        """Starts reading all of batch array ``sub``, or only the elements of its ``files``."""
        check_name(sub)  # never a path outside the checkpoint
        files = range(-(-size // chunk)) if files is None else files
        first = files.start * chunk if files else 0
        stop = min(size, files.stop * chunk) if files else 0
        read = PendingRead((stop - first,), dtype)
        flat = read.out.view(np.uint8)
        itemsize, kw = read.out.dtype.itemsize, self._fill_kw()
        sizes = (size * itemsize, chunk * itemsize, inner * itemsize, first * itemsize)
        for s in files:
            path = os.path.join(self._root, sub, *_chunks.chunk_parts((s,)))
            read.futures.append(self._pool.submit(_read_shard, path, flat, s, *sizes, **kw))
        return read

    def read_batch_range(
        self, sub: str, size: int, chunk: int, inner: int, dtype, start: int, stop: int
    ) -> PendingRead:
        """Starts reading elements ``[start, stop)`` of batch array ``sub``, rounded out to
        whole inner chunks (the result's ``first``: where its ``out`` starts)."""
        check_name(sub)  # never a path outside the checkpoint
        if self._ranged is None or not 0 <= start < stop <= size:
            raise ValueError(f"batch {sub}: no ranged read of [{start}, {stop}) here")
        lo, hi = start // inner * inner, min(size, -(-stop // inner) * inner)
        read = PendingRead((hi - lo,), dtype)
        read.first, read.files = lo, list(range(lo // chunk, -(-hi // chunk)))
        itemsize = read.out.dtype.itemsize
        flat = read.out.view(np.uint8)
        kw = {} if self._fill is _read_file else {**self._fill_kw(), "ranged": self._ranged}
        for s in read.files:
            end = min(hi, (s + 1) * chunk)
            inners = (max(lo - s * chunk, 0) // inner, -(-(end - s * chunk) // inner))
            path = os.path.join(self._root, sub, *_chunks.chunk_parts((s,)))
            args = (size * itemsize, chunk * itemsize, inner * itemsize, lo * itemsize)
            job = self._batch_pool.submit(_read_shard, path, flat, s, *args, inners, **kw)
            read.futures.append(job)
            read.ends.append(end)
        return read


class PendingRead:
    """One array being read; ``deferred``: its jobs start only once it is waited for."""

    deferred = False

    def __init__(self, shape, dtype):
        self.out = _host.empty(tuple(shape), dtype)  # adopted by jax on CPU without a copy
        self.futures: list[concurrent.futures.Future] = []
        self.first = 0  # ranged batch reads (read_batch_range): see there
        self.files: list[int] = []
        self.ends: list[int] = []

    def result(self) -> np.ndarray:
        for future in self.futures:
            future.result()
        return self.out


_read_lock = threading.Lock()
_read_total = 0


def count_read(nbytes: int) -> None:
    """Adds ``nbytes`` read elsewhere (a subclass) to :func:`bytes_read`."""
    global _read_total
    with _read_lock:
        _read_total += nbytes


def bytes_read() -> int:
    """Bytes this process has read through :class:`ChunkReader` and its subclass."""
    with _read_lock:
        return _read_total


def _read_chunk(path: str, dest: np.ndarray, chunk_bytes: int, *, fill=None, where=None) -> None:
    """Reads one chunk file into ``dest`` (its padding into scratch), then checks its crc32c."""
    name = file_name(path)
    parts = [dest]
    if chunk_bytes > dest.size:
        parts.append(np.empty(chunk_bytes - dest.size, np.uint8))
    trailer = np.empty(_chunks.CRC_BYTES, np.uint8)
    (fill or _read_file)(path, name, parts + [trailer])
    if not crc_matches(parts, trailer):
        raise ValueError(f"{stored_name(path, where, 'chunk')}: crc32c checksum mismatch")


def _read_chunk_copy(
    path: str, dest: np.ndarray, chunk: tuple, scratch: dict, src=None, *, fill=None, where=None
) -> None:
    """Reads one chunk file whole into this thread's scratch (kept: fresh memory costs its
    first touch), checks it, then copies its part ``src`` into ``dest``."""
    nbytes = int(np.prod(chunk, dtype=np.int64)) * dest.dtype.itemsize
    me = threading.get_ident()
    buffer = scratch.get(me)
    if buffer is None or buffer.size < nbytes:
        buffer = scratch[me] = np.empty(nbytes, np.uint8)
    raw = buffer[:nbytes]
    _read_chunk(path, raw, nbytes, fill=fill, where=where)
    src = src or tuple(slice(0, n) for n in dest.shape)
    dest[...] = raw.view(dest.dtype).reshape(chunk)[src]


def _read_shard(
    path: str,
    flat: np.ndarray,
    s: int,
    size: int,
    chunk: int,
    inner: int,
    base: int = 0,
    inners: tuple[int, int] | None = None,
    *,
    fill=None,
    ranged=None,
    where=None,
) -> None:
    """Reads one batch file (a zarr3 shard) into ``flat`` from byte ``base`` on, then checks
    its index and every checksum. With ``inners`` (j0, j1): only those inner chunks."""
    name, label = file_name(path), stored_name(path, where, "batch file")
    count = chunk // inner
    present = -(-min(size - s * chunk, chunk) // inner)
    j0, j1 = inners or (0, present)
    parts: list[np.ndarray] = []
    checks: list[tuple[list[np.ndarray], np.ndarray]] = []
    for j in range(j0, j1):
        start = s * chunk + j * inner
        data = [flat[start - base : min(start + inner, size) - base]]
        if data[0].size < inner:
            data.append(np.empty(inner - data[0].size, np.uint8))
        trailer = np.empty(_chunks.CRC_BYTES, np.uint8)
        parts += data + [trailer]
        checks.append((data, trailer))
    index = np.empty(2 * count, "<u8")
    index_trailer = np.empty(_chunks.CRC_BYTES, np.uint8)
    tail = [index.view(np.uint8), index_trailer]
    if (j0, j1) == (0, present):
        (fill or _read_file)(path, name, parts + tail)
    else:
        stride = inner + _chunks.CRC_BYTES
        ranges = [(j0 * stride, parts), (present * stride, tail)]
        expected_bytes = present * stride + index.nbytes + _chunks.CRC_BYTES
        (ranged or _read_ranges)(path, name, expected_bytes, ranges)
    if not crc_matches([index.view(np.uint8)], index_trailer):
        raise ValueError(f"{label}: crc32c checksum mismatch in its index")
    expected = np.full(2 * count, _chunks.MISSING_ENTRY, "<u8")
    expected[0 : 2 * present : 2] = np.arange(present, dtype="<u8") * (inner + _chunks.CRC_BYTES)
    expected[1 : 2 * present : 2] = inner + _chunks.CRC_BYTES
    if not np.array_equal(index, expected):
        raise ValueError(f"{label}: its index does not list the expected chunks")
    for j, (data, trailer) in enumerate(checks, j0):
        if not crc_matches(data, trailer):
            raise ValueError(f"{label}: crc32c checksum mismatch in inner chunk {j}")


def _read_file(path: str, name: str, parts: list[np.ndarray]) -> None:
    """Fills ``parts`` with the whole regular file at ``path`` (no link), of exactly their size."""
    _read_ranges(path, name, sum(p.size for p in parts), [(0, parts)])


def _read_ranges(path: str, name: str, expected: int, ranges: list) -> None:
    """Fills each ``(offset, parts)`` of ``ranges`` from the regular file at ``path``."""
    _env.fail_point("read_chunk")
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
    total = 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != expected:
            raise ValueError(
                f"chunk {name}: expected a file of {expected} bytes, found {st.st_size}"
            )
        if len(ranges) > 1 and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for at, parts in ranges:
            total += preadv_into(fd, parts, at, name) - at
    finally:
        os.close(fd)
        count_read(total)


def preadv_into(fd: int, parts: list[np.ndarray], at: int, name: str) -> int:
    """Fills ``parts`` from ``fd`` at ``at``; returns the offset after (ValueError: ended early)."""
    views = [memoryview(p) for p in parts if p.size]
    while views:
        got = os.preadv(fd, views[: _chunks.IOV_MAX], at)
        if got == 0:
            raise ValueError(f"chunk {name}: ended early")
        at += got
        _chunks.advance(views, got)
    return at
