"""Host buffers for snapshots and restores.

Two properties matter and numpy's defaults give neither:

* 64-byte alignment: jax on CPU adopts such a numpy buffer without copying it
  (``jax.device_put``); numpy's large allocations are only 16-byte aligned, so a
  restored leaf would be copied once more.
* no transparent huge pages: numpy asks for them on large allocations, and where the
  kernel compacts memory to serve them (``defrag=madvise``) first-touching a fresh
  buffer was measured 4x slower here (1.2 GB: 2.65 s against 0.6 s).

Thread-safety: numpy's huge-page switch is process-wide; it is flipped only around
the allocation itself, which merely changes a hint for other threads' allocations.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import mmap
import os
import sys
import threading

import numpy as np

ALIGNMENT = 64
PAGE = 4096  # the alignment of pooled buffers: O_DIRECT writes straight from them

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # pragma: no cover - other numpy layouts
    _set_madvise_hugepage = None


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary, and
    on a page (4096 bytes) from 64 KiB on: direct I/O reads and writes it in place."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    align = PAGE if nbytes >= 1 << 16 else ALIGNMENT
    previous = _set_madvise_hugepage(False) if _set_madvise_hugepage else None
    try:
        raw = np.empty(nbytes + align, dtype=np.uint8)
    finally:
        if previous is not None:
            _set_madvise_hugepage(previous)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def copy(array: np.ndarray) -> np.ndarray:
    """An aligned copy of ``array``."""
    out = empty(array.shape, array.dtype)
    np.copyto(out, array)
    return out


COPY_PIECE = 32 << 20  # bytes per copy job of :func:`copy_all`
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


def copy_all(pairs: list[tuple]) -> None:
    """``np.copyto(dst, src)`` for every (dst, src) of ``pairs`` (C-contiguous ``dst``),
    split into pieces of at most :data:`COPY_PIECE` bytes and run on up to
    :data:`COPY_THREADS` threads (numpy releases the GIL while copying): a blocking
    phase's memory copies at the machine's memory bandwidth rather than one core's.
    An item (dst, src, copier) is copied by ``copier(dst, src)`` instead, whole, on one
    of the threads (a copy that checksums as it goes: ``_zarr.chunks.copy_with_crcs``;
    the caller cuts it into pieces). Returns when every copy is done; the first error is
    raised."""
    jobs: list[tuple] = []
    for dst, src, *copier in pairs:
        if copier or dst.nbytes <= COPY_PIECE or src.ndim == 0 or src.shape[0] < 2:
            jobs.append((dst, src, *copier))
            continue
        rows = max(1, COPY_PIECE // max(1, dst.nbytes // dst.shape[0]))
        jobs += [(dst[i : i + rows], src[i : i + rows]) for i in range(0, dst.shape[0], rows)]
    if len(jobs) < 2 or COPY_THREADS == 1 or sum(j[0].nbytes for j in jobs) < 2 * COPY_PIECE:
        for job in jobs:
            _copy_job(*job)
        return
    with concurrent.futures.ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="fop-copy") as ex:
        for future in [ex.submit(_copy_job, *job) for job in jobs]:
            future.result()


def _copy_job(dst: np.ndarray, src: np.ndarray, copier=np.copyto) -> None:
    copier(dst, src)


MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def populate(buffer: np.ndarray) -> bool:
    """Makes every page of ``buffer`` (C-contiguous, page-aligned start) resident and
    writable now: ``madvise(MADV_POPULATE_WRITE)`` where the kernel has it (one call
    faults every page in, without a fault per page), else one byte written per page.
    Returns whether madvise did it. The values are not meaningful either way."""
    flat = buffer.reshape(-1).view(np.uint8)
    address, length = flat.ctypes.data, flat.size - flat.size % PAGE
    if _madvise is not None and length and address % PAGE == 0:
        if _madvise(address, length, MADV_POPULATE_WRITE) == 0:
            return True
    flat[::PAGE] = 0  # an older kernel (EINVAL): a write fault per page
    return False


class BufferPool:
    """Snapshot buffers reused from one save to the next (a manager's saves).

    A fresh host buffer costs its first touch (page faults: about 0.6 s per GB on this
    kind of machine), and so does a zero-copy snapshot of CPU arrays, one step later:
    while the snapshot's views are alive the training step cannot donate its state and
    allocates fresh outputs instead. A copy into memory that was touched before costs
    only the copy. The pool holds the buffers of the last save that gave its buffers
    back (one host copy of what it saved) for the next snapshot to take.

    Thread-safety and call order: :meth:`empty` is called by the blocking phase
    (training thread), :meth:`give_back` by the background write once tensorstore no
    longer reads the buffers (another thread); one lock guards the free lists. A buffer
    is handed out only after it was given back, so a save still writing never has its
    buffers overwritten, whatever the saves' overlap.
    """

    MIN_BYTES = 1 << 16  # smaller buffers come from malloc's heap cheaply anyway

    def __init__(self):
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self.allocated = 0  # buffers of MIN_BYTES or more made fresh by empty()
        self.reused = 0  # buffers empty() took from the free lists

    def reserve(self, sizes: list[int]) -> int:
        """Makes the free lists hold one buffer per byte size of ``sizes`` (those of one
        save, ``_core.save.pool_sizes``), each populated (:func:`populate`): the first
        save then takes buffers that were touched before, without page faults. Buffers
        already free count; returns the bytes newly allocated. Call before the loop, with
        no save in flight (the training thread)."""
        want: dict[int, int] = {}
        for n in sizes:
            if n >= self.MIN_BYTES:
                want[n] = want.get(n, 0) + 1
        made = 0
        with self._lock:
            free = {n: list(a) for n, a in self._free.items()}
        for n, count in want.items():
            have = free.setdefault(n, [])
            while len(have) < count:
                raw = empty((n,), np.uint8)
                populate(raw)
                have.append(raw)
                made += n
        with self._lock:
            self._free = free
        return made

    def empty(self, shape, dtype) -> np.ndarray:
        """As :func:`empty`, from the pool when a given-back buffer has the size."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        raw = None
        if nbytes >= self.MIN_BYTES:
            with self._lock:
                free = self._free.get(nbytes)
                if free:
                    raw = free.pop()
                    self.reused += 1
                else:
                    self.allocated += 1
        if raw is None:
            raw = empty((nbytes,), np.uint8)
        return raw.view(dtype).reshape(shape)

    def copy(self, array: np.ndarray, later: list | None = None) -> np.ndarray:
        """A pooled copy of ``array``; with ``later``, the copy is only appended to it as
        (buffer, array), for :func:`copy_all` to make."""
        out = self.empty(array.shape, array.dtype)
        if later is None:
            np.copyto(out, array)
        else:
            later.append((out, array))
        return out

    def give_back(self, arrays) -> None:
        """Makes ``arrays`` (from :meth:`empty`, no longer read) the pool's free buffers;
        buffers given back earlier and not taken since are dropped, so the pool never
        holds more than one save's worth."""
        free: dict[int, list[np.ndarray]] = {}
        for a in arrays:
            if a.nbytes >= self.MIN_BYTES and a.flags.c_contiguous:
                free.setdefault(a.nbytes, []).append(a.reshape(-1).view(np.uint8))
        with self._lock:
            self._free = free

    def clear(self) -> None:
        with self._lock:
            self._free = {}

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for free in self._free.values() for a in free)
