"""The process's shared reader threads of :class:`~chunk_files.ChunkReader`: started
once, not on every restore, and forgotten in a forked child (where they do not run).
Threading: any thread.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading


class Jobs:
    """This reader's jobs on the process's shared pool of ``threads`` reader threads:
    started once, not on every restore (starting 8 threads cost 0.1 s of a 0.5 s
    restore of 6,000 small leaves on a busy machine). :meth:`shutdown` cancels this
    reader's jobs not started yet and waits for the rest, leaving others' jobs alone."""

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


# What the kernel is asked to read ahead: about what a disk reads while the metadata
# of a large tree is parsed, and never a checkpoint's worth of page cache at once.
PREFETCH_BYTES = 256 << 20


def prefetch_batches(root: str, threads: int) -> concurrent.futures.Future | None:
    """Asks the kernel to start reading the batch files under ``root/b`` (a hint:
    ``POSIX_FADV_WILLNEED``; the first :data:`PREFETCH_BYTES` of them), on one of the
    shared reader threads, so that the disk works while the restoring thread parses
    the metadata; None where there is no such hint. For a restore that reads every
    batch whole: the later reads check every byte as before; only the regular files
    under ``b/*/c`` are opened (never through a link). Nothing is allocated or kept;
    a failure is the later read's to report."""
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
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
