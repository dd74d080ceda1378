"""A manager's snapshot buffers, reused from one save to the next
(``reuse_host_buffers=True``), and the populating of fresh ones.

Thread-safety: :class:`BufferPool` is locked; :func:`populate`: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.host``.
"""

from __future__ import annotations

import collections
import ctypes
import math
import mmap
import sys
import threading

import numpy as np

from .host import PAGE, empty

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
    """Makes every page of ``buffer`` (C-contiguous, page-aligned) resident and writable
    now: ``madvise(MADV_POPULATE_WRITE)`` where the kernel has it, else one byte written
    per page (the values are garbage either way). Returns whether madvise did it."""
    flat = buffer.reshape(-1).view(np.uint8)
    address, length = flat.ctypes.data, flat.size - flat.size % PAGE
    if _madvise is not None and length and address % PAGE == 0:
        if _madvise(address, length, MADV_POPULATE_WRITE) == 0:
            return True
    flat[::PAGE] = 0  # an older kernel (EINVAL): a write fault per page
    return False


class BufferPool:
    """The buffers of the last save that gave its buffers back: a fresh buffer costs its
    page faults (about 0.6 s per GB), one touched before only the copy.

    Call order: :meth:`empty` from the blocking phase (training thread), :meth:`give_back`
    from the background write once nothing reads the buffers; one lock guards the free
    lists. A buffer is handed out only after it was given back.
    """

    MIN_BYTES = 1 << 16  # smaller buffers come from malloc's heap cheaply anyway

    def __init__(self):
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self.allocated = 0  # buffers of MIN_BYTES or more made fresh by empty()
        self.reused = 0  # buffers empty() took from the free lists

    def reserve(self, sizes: list[int]) -> int:
        """Makes the free lists hold one populated buffer per byte size of ``sizes`` (one
        save's, ``_core.pool_sizes``); returns the bytes newly allocated. Call with no
        save in flight (the training thread)."""
        want = collections.Counter(n for n in sizes if n >= self.MIN_BYTES)
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

    def copy(self, array: np.ndarray) -> np.ndarray:
        """A pooled copy of ``array``."""
        out = self.empty(array.shape, array.dtype)
        np.copyto(out, array)
        return out

    def give_back(self, arrays) -> None:
        """Makes ``arrays`` (from :meth:`empty`, no longer read) the free buffers, dropping
        those given back earlier: the pool holds one save's worth at most."""
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
