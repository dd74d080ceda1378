"""This process: its end, its save in flight, its host buffers, who it is among the
others, what its threads do (:data:`ACTIVITIES`), Pathways detection.

Exit steps run on the main thread at exit, in order FINISH, LEAVE, ANNOUNCE (``at_exit``
from any thread); :data:`ACTIVITIES` is thread-safe; the rest: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.host``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import concurrent.futures.thread
import contextlib
import dataclasses
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .._errors import UnsupportedRuntimeError
from . import env as _env

FINISH, LEAVE, ANNOUNCE = 0, 1, 2  # the exit steps, in the order they run
_STEPS: dict[int, Callable[[], bool]] = {}  # step -> its work
_LOCK = threading.Lock()
logger = logging.getLogger("flax_orbax_plugin")


def at_exit(step: int, work: Callable[[], bool]) -> None:
    """Runs ``work`` (once) as ``step`` when the program ends; ``work`` returns True when
    the program must exit with status 1."""
    with _LOCK:
        if not _STEPS:
            threading._register_atexit(_run)  # type: ignore[attr-defined]
        _STEPS.setdefault(step, work)


# The process's latest ``fop.save_async`` until nothing of it is left to report: a second
# save waits for it, a restore or verify of its path too.
_IN_FLIGHT: list[Any] = []


def in_flight(handle: Any) -> None:
    """``handle`` (a ``SaveHandle``) is the latest save in flight (caller holds its lock)."""
    _IN_FLIGHT[:] = [handle]


def settled(handle: Any) -> None:
    """``handle`` has nothing left to report: no save or read waits for it any longer."""
    with contextlib.suppress(ValueError):
        _IN_FLIGHT.remove(handle)


def wait_for_pending_save(location: Any = None) -> None:
    """Waits for the save in flight (only if it targets ``location``, a Location, when
    given); re-raises an error that its ``wait()`` has not already reported."""
    for handle in list(_IN_FLIGHT):
        if location is None or handle.path == str(location):
            handle.raise_unreported()


def _run() -> None:
    failed = False
    for step in sorted(_STEPS):
        try:
            failed = bool(_STEPS[step]()) or failed
        except Exception:  # the program is ending: said, then the next step
            logger.exception("flax_orbax_plugin: a step at exit failed")
    if failed:  # a lost step is not a success: the exit status says so (1)
        print("flax_orbax_plugin: exit status 1 (a save failed at exit)", file=sys.stderr)
        atexit._run_exitfuncs()  # the program's own exit handlers still run, then
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


ALIGNMENT = 64
PAGE = 4096  # the alignment of pooled buffers: O_DIRECT writes straight from them

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:  # pragma: no cover - other numpy layouts
    _set_madvise_hugepage = None


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array aligned to 64 bytes, to a page from 64 KiB on."""
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
    out = empty(array.shape, array.dtype)
    np.copyto(out, array)
    return out


COPY_PIECE = 32 << 20  # bytes per copy job of :func:`copy_all`
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


def copy_all(pairs: list[tuple]) -> None:
    """``np.copyto(dst, src)`` for every (dst, src) of ``pairs``, in :data:`COPY_PIECE` pieces
    on :data:`COPY_THREADS` threads (memory bandwidth, not one core's); an item (dst, src,
    copier) is copied whole by ``copier``. Returns when all are done; the first error raised."""
    jobs: list[tuple] = []
    for dst, src, *copier in pairs:
        if copier or dst.nbytes <= COPY_PIECE or src.ndim == 0 or src.shape[0] < 2:
            jobs.append((copier[0] if copier else np.copyto, dst, src))
            continue
        rows = max(1, COPY_PIECE // max(1, dst.nbytes // dst.shape[0]))
        jobs += [
            (np.copyto, dst[i : i + rows], src[i : i + rows]) for i in range(0, len(dst), rows)
        ]
    if len(jobs) < 2 or COPY_THREADS == 1 or sum(j[1].nbytes for j in jobs) < 2 * COPY_PIECE:
        for copier, dst, src in jobs:
            copier(dst, src)
        return
    with concurrent.futures.ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="fop-copy") as ex:
        for future in [ex.submit(*job) for job in jobs]:
            future.result()


process_index = jax.process_index  # who this process is among the others
process_count = jax.process_count


def is_primary() -> bool:
    return jax.process_index() == 0


@dataclasses.dataclass
class Progress:
    """Bytes an activity moved of those handed to it so far: written by the thread doing
    the work, read by the heartbeat thread."""

    done: int = 0
    total: int = 0


@dataclasses.dataclass
class _Activity:
    what: str
    since: float
    progress: Progress | None = None


class Activities:
    """What this process's threads are doing (a stack per thread, innermost last)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stacks: dict[int, list[_Activity]] = {}

    @contextlib.contextmanager
    def doing(self, what: str, *, moving: bool = False) -> Iterator[Progress | None]:
        """Records ``what`` as this thread's current activity for the body; ``moving``:
        the body moves bytes and reports them in the :class:`Progress` it is given."""
        entry = self.begin(what, moving=moving)
        try:
            yield entry.progress
        finally:
            self.end(entry)

    def begin(self, what: str, *, moving: bool = False) -> _Activity:
        """:meth:`doing` for a body that is no ``with`` block: pair with :meth:`end`."""
        entry = _Activity(what, time.monotonic(), Progress() if moving else None)
        with self._lock:
            self._stacks.setdefault(threading.get_ident(), []).append(entry)
        return entry

    def end(self, entry: _Activity) -> None:
        """Ends ``entry`` (begun on this thread)."""
        me = threading.get_ident()
        with self._lock:
            stack = self._stacks.get(me, [])
            if entry in stack:
                stack.remove(entry)
            if not stack:
                self._stacks.pop(me, None)

    def stacks(self) -> list[list[_Activity]]:
        """A copy of each busy thread's activities, outermost first (for the heartbeat)."""
        with self._lock:
            return [list(s) for s in self._stacks.values() if s]


ACTIVITIES = Activities()  # this process's (one per process, like its coordination client)


PROXY = "proxy"  # the platform name of the IFRT proxy backend Pathways runs behind


def detected() -> str | None:
    """How Pathways was recognised (words for the message), or None."""
    platforms = jax.config.jax_platforms or ""
    if PROXY in [p.strip() for p in platforms.split(",")]:
        return f"jax_platforms is {platforms!r}"
    bridge = sys.modules.get("jax._src.xla_bridge")  # only a backend already made
    backends = getattr(bridge, "_backends", None) or {}
    return "the proxy backend is initialised" if PROXY in backends else None


def refuse_if_detected(operation: str) -> None:
    """UnsupportedRuntimeError when Pathways is detected (unless ``FOP_PATHWAYS=allow``)."""
    how = detected()
    if how is None or _env.read("FOP_PATHWAYS") == "allow":
        return
    raise UnsupportedRuntimeError(
        f"{operation}: Pathways (single-controller JAX) detected ({how}): run one process per"
        f" host (multi-controller JAX), or Orbax with pathwaysutils; FOP_PATHWAYS=allow runs"
        f" it anyway (untested: every shard passes through the controller's host memory)"
    )
