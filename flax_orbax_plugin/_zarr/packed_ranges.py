"""Byte-range reads of version-2 data files on an object store, coalesced.

A restore reads a leaf's chunks; in a data file they lie mostly side by side (a
process's writer fills one file per array at a time). :meth:`RangeReads.prefetch`
issues one byte-range GET per run of adjacent segments (up to :data:`RUN_BYTES`) the
read needs, before its chunk jobs start; :meth:`RangeReads.take` hands each job its
segment's bytes from its run (or None: the job reads its segment alone). A run's bytes
are dropped once every segment of it was taken. Thread-safe (a lock guards the runs).
"""

from __future__ import annotations

import threading

from . import packed_index as _index

RUN_BYTES = 64 << 20  # at most this many bytes per coalesced GET


class _Run:
    def __init__(self, future, start: int):
        self.future = future
        self.start = start


class RangeReads:
    """Coalesced reads of the segments ``chunks`` lists, through the open kvstore ``kv``
    (rooted at the checkpoint's ``data/``)."""

    def __init__(self, kv, chunks: dict[str, _index.Segment]):
        self._kv = kv
        self._chunks = chunks
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}  # key -> the run holding its segment

    def prefetch(self, keys) -> None:
        """Starts one GET per run of adjacent segments among ``keys`` (those of one
        read; keys already waiting in a run, or not listed, are left out)."""
        by_file: dict[str, list[tuple[int, str, _index.Segment]]] = {}
        with self._lock:
            for key in keys:
                segment = self._chunks.get(key)
                if segment is not None and key not in self._runs:
                    by_file.setdefault(segment.file, []).append((segment.offset, key, segment))
        runs = []
        for file, items in by_file.items():
            items.sort()
            run: list = []
            for offset, key, segment in items:
                if run and (
                    offset != run[-1][2].offset + run[-1][2].length
                    or offset + segment.length - run[0][0] > RUN_BYTES
                ):
                    runs.append((file, run))
                    run = []
                run.append((offset, key, segment))
            if run:
                runs.append((file, run))
        for file, run in runs:
            if len(run) < 2:
                continue  # read alone by its job
            start = run[0][0]
            stop = run[-1][0] + run[-1][2].length
            future = self._kv.read(file, byte_range=slice(start, stop))
            entry = _Run(future, start)
            with self._lock:
                for _, key, _ in run:
                    self._runs[key] = entry

    def take(self, key: str, segment: _index.Segment) -> bytes | memoryview | None:
        """The bytes of ``key``'s segment from its run; None when it is in none (or the
        run came back short: the caller reads the segment alone and reports it)."""
        with self._lock:
            run = self._runs.pop(key, None)
        if run is None:
            return None
        result = run.future.result()
        if result.state != "value":
            return None
        lo = segment.offset - run.start
        value = memoryview(result.value)[lo : lo + segment.length]
        return value if len(value) == segment.length else None
