"""Host memory: the ceiling (its options declared and checked, what it allows when an
operation starts: :func:`resolve`, a manager's save budget under it: :func:`save_budget`)
and a manager's snapshot buffers reused from one save to the next (:class:`BufferPool`).

Pure functions over frozen declarations (they read ``/proc`` and ``/sys``), any thread;
:class:`BufferPool` is locked.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.host``.
"""

from __future__ import annotations

import collections
import ctypes
import math
import mmap
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import OptionError
from . import tree as _tree
from .env import INT64_MAX, Option, check, found
from .host import PAGE, empty
from .keywords import refuse_without
from .shown import outside_stacklevel

AUTO = "auto"
AUTO_FRACTION = 0.5  # the share of the memory free when an operation starts "auto" allows
_CGROUP_V2 = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")  # (limit, usage)
_CGROUP_V1 = (
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    "/sys/fs/cgroup/memory/memory.usage_in_bytes",
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes() -> int | None:
    """Host memory free for this process now: the smaller of ``MemAvailable`` and the
    cgroup's limit less its usage; None where neither can be read."""
    figures = [_meminfo_available()]
    for limit_path, usage_path in (_CGROUP_V2, _CGROUP_V1):
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < INT64_MAX // 2:
            figures.append(max(0, limit - usage))
            break
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def resolve(ceiling: int | str | None) -> int | None:
    """The bytes ``ceiling`` allows now: itself (an int), :data:`AUTO_FRACTION` of
    :func:`available_bytes` (``"auto"``; None where that is unknown), or None."""
    if ceiling != AUTO:
        return ceiling  # type: ignore[return-value]
    free = available_bytes()
    return None if free is None else max(1, int(free * AUTO_FRACTION))


def _shards(leaf: Any) -> list[tuple[tuple[int, ...], int]]:
    """``[(shape, itemsize)]`` of the pieces of ``leaf`` this process holds."""
    dtype = getattr(leaf, "dtype", None)
    shape = getattr(leaf, "shape", None)
    if dtype is None or shape is None or not hasattr(dtype, "itemsize"):
        return []
    deleted = getattr(leaf, "is_deleted", None)
    if callable(deleted) and deleted():  # the save's own check names the leaf
        return []
    shards = getattr(leaf, "addressable_shards", None)
    if shards is None:
        return [(tuple(shape), dtype.itemsize)]
    out = []
    for shard in shards:
        dims = tuple(
            len(range(*s.indices(n))) if isinstance(s, slice) else 1
            for s, n in zip(shard.index, shape, strict=False)
        )
        out.append((dims + tuple(shape[len(dims) :]), dtype.itemsize))
    return out


def held_bytes(tree: Any) -> int:
    """Bytes of the array leaves of ``tree`` this process holds (its shards)."""
    leaves = [leaf for _, _, leaf in _tree.flatten(tree)[0]]
    return sum(math.prod(s) * size for leaf in leaves for s, size in _shards(leaf))


def largest_row(tree: Any) -> tuple[int, str]:
    """``(bytes, leaf path)`` of the largest row (one index of a shard's first axis)
    among the array leaves of ``tree``: the least a streamed save copies at once."""
    best, where = 0, ""
    for path, _, leaf in _tree.flatten(tree)[0]:
        for shape, size in _shards(leaf):
            row = math.prod(shape[1:]) * size if shape else size
            if row > best:
                best, where = row, path
    return best, where


def save_budget(given: int | str | None, items: Any, incremental: bool) -> tuple[Any, Any]:
    """``(ceiling, budget)`` of one save of ``items`` under ``given``: the ceiling in bytes now
    (None: no bound), the budget the save streams under (under ``"auto"`` only when this
    process's share does not fit, never ``incremental``); OptionError below the largest row."""
    ceiling = resolve(given)
    if ceiling is None:
        return None, None
    if not isinstance(given, int) and (incremental or held_bytes(items) <= ceiling):
        return ceiling, None
    row, path = largest_row(items)
    if row > ceiling:
        shown = given if isinstance(given, int) else repr(AUTO)
        raise OptionError(
            f"host_memory={shown}: a save copies at least one row at a time, a row of leaf "
            f"{path!r} holds {row} bytes, over the ceiling of {ceiling} bytes; nothing was "
            f"written: raise host_memory to at least {row}, or give host_memory=None"
        )
    return ceiling, ceiling


def check_ceiling(value: Any) -> int | str | None:
    """``value`` if it is a ceiling (bytes, ``"auto"`` or None); else ValueError / TypeError."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        index = getattr(value, "__index__", None)  # numpy integer scalars
        if index is None or isinstance(value, bool):
            expected = "expected a positive int of bytes, 'auto' or None"
            raise TypeError(f"{expected}, found {found(value)}")
        value = index()
    if not 1 <= value <= INT64_MAX:
        raise ValueError(f"expected a positive int of bytes <= {INT64_MAX}, found {value}")
    return int(value)


HOST_MEMORY = Option(
    "host_memory",
    "custom",
    none_ok=True,
    convert=check_ceiling,
    default=AUTO,
    annotation="int | str",
    doc="the host-memory ceiling, bytes any save, restore or resume holds beyond "
    "the state: an int (a save streams under it), 'auto' (half the memory free when a save "
    "starts: it streams only when the state does not fit) or None (no bound)",
)
"""A manager's (and a callback's) one ceiling (docs/manager.md, "Host memory")."""

HOST_MEMORY_BUDGET = Option(  # fop.save's, and the manager's host_memory by its old name
    "host_memory_budget",
    "int",
    none_ok=True,
    low=1,
    high=INT64_MAX,
    expected=f"a positive int <= {INT64_MAX} or None",
    doc="host bytes a step may hold beyond the state (None: no bound)",
)


def take_old_name(given: Mapping[str, Any], owner: str = "") -> dict[str, Any]:
    """A manager's options ``given`` with ``host_memory_budget=`` (the earlier name) checked and
    turned into ``host_memory=``, with a DeprecationWarning; ``owner``: the messages' prefix."""
    old = HOST_MEMORY_BUDGET.name
    if old not in given:
        return dict(given)
    value = check((HOST_MEMORY_BUDGET,), {old: given[old]})[old]
    if "host_memory" in given:
        raise OptionError(
            f"{owner}{old}={given[old]!r} and host_memory={given['host_memory']!r} are one "
            f"option ({old}= is its earlier name): give host_memory= alone"
        )
    warnings.warn(
        f"{owner}{old}=: deprecated, and gone in the next release; write host_memory={value!r}",
        DeprecationWarning,
        stacklevel=outside_stacklevel(),
    )
    return {k: v for k, v in given.items() if k != old} | {"host_memory": value}


def refuse_idle(out: Mapping[str, Any]) -> None:
    """Refuses in a manager's checked options ``out`` a ceiling of bytes with incremental
    steps, and ``reuse_host_buffers=True`` under a ceiling of bytes (nothing is pooled)."""
    ceiling = out["host_memory"]
    if not isinstance(ceiling, int):
        return
    if out["incremental"]:
        needs = "incremental=False (an incremental step copies every region to host first)"
        refuse_without("host_memory", ceiling, needs)
    refuse_without(
        "reuse_host_buffers",
        out["reuse_host_buffers"],
        "host_memory=None or 'auto' (under a ceiling of bytes nothing is pooled: each "
        "save streams, CPU arrays are written from their own memory)",
        default=False,
    )


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
    now; whether ``madvise(MADV_POPULATE_WRITE)`` did it (else one byte written per page)."""
    flat = buffer.reshape(-1).view(np.uint8)
    address, length = flat.ctypes.data, flat.size - flat.size % PAGE
    if _madvise is not None and length and address % PAGE == 0:
        if _madvise(address, length, MADV_POPULATE_WRITE) == 0:
            return True
    flat[::PAGE] = 0  # an older kernel (EINVAL): a write fault per page
    return False


class BufferPool:
    """The buffers of the last save that gave them back (``reuse_host_buffers=True``): a
    fresh buffer costs its page faults (about 0.6 s per GB), one touched before only the copy.

    Call order: :meth:`empty` from the blocking phase (training thread), :meth:`give_back`
    from the background write once nothing reads them; one lock guards the free lists.
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
        out = self.empty(array.shape, array.dtype)
        np.copyto(out, array)
        return out

    def give_back(self, arrays) -> None:
        """Makes ``arrays`` (no longer read) the free buffers: one save's worth at most."""
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
