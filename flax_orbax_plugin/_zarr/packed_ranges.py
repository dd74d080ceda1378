"""The fetch plan of a version-2 restore on an object store: few GETs, bounded memory.

A restore first declares every chunk it will read (:meth:`RangeReads.want`, by the
reads it issues); the first chunk it waits for plans them all (:meth:`RangeReads.plan`):
per data file, the wanted segments sorted by offset are merged into ranges wherever the
gap between two is under :data:`GAP_BYTES` (fetching a small gap is cheaper than a
request), and a file whose wanted bytes are at least :data:`WHOLE_FRACTION` of it is
fetched whole with one plain GET. The plan starts the ranges' GETs at once, in the
order the reads need them, side by side (several files at a time), while the fetched
bytes held stay under :data:`FETCH_BYTES` (one range may pass it when none is held);
a range's bytes are dropped once every chunk wanted from it was taken
(:meth:`RangeReads.take`, on the reader's threads), which starts the next ones. A
chunk job that needs a range not yet started starts it; if it does not fit the bound,
it is split and only a run of at most :data:`PIECE_BYTES` from the chunk that asked is
fetched. Only wanted segments are ever handed out (and each is checked by the
caller: length and crc32c); a resharding restore wants only its shards' chunks.
Thread-safe (one lock guards the plan and the ranges).
"""

from __future__ import annotations

import collections
import threading

from . import packed_index as _index

GAP_BYTES = 1 << 20  # a gap under this between wanted segments is fetched with them
WHOLE_FRACTION = 0.75  # this share of a data file wanted: the whole object, one GET
FETCH_BYTES = 1 << 30  # at most this many fetched bytes held at once (see above)
PIECE_BYTES = 64 << 20  # the most a range split for the memory bound fetches


class _Range:
    """Wanted segments ``items`` [(offset, length, key)] of data file ``file``, one GET."""

    def __init__(self, file: str, items: list, whole: int | None = None):
        self.file = file
        self.items = items
        self.whole = whole  # the file's size when the plain GET of the object is meant
        self.start = 0 if whole is not None else items[0][0]
        self.stop = whole if whole is not None else items[-1][0] + items[-1][1]
        self.future = None
        self.left = 0  # takes to come before its bytes are dropped
        self.value: memoryview | None = None  # the fetched bytes, once (see ``bytes``)
        self.lock = threading.Lock()

    def bytes(self) -> memoryview:
        """The fetched bytes (empty when the object is missing). Taken from the result
        once: every ``ReadResult.value`` is a fresh copy of the whole range."""
        with self.lock:
            if self.value is None:
                result = self.future.result()
                self.value = memoryview(result.value if result.state == "value" else b"")
            return self.value

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def plan_file(file: str, items: list, size: int) -> list[_Range]:
    """The ranges that fetch ``items`` [(offset, length, key)] (sorted, any repeats
    dropped) of data file ``file`` of ``size`` bytes."""
    needed = sum(length for _, length, _ in items)
    if size and needed >= WHOLE_FRACTION * size:
        return [_Range(file, items, whole=size)]
    ranges: list[_Range] = []
    run: list = []
    for item in items:
        if run and item[0] - (run[-1][0] + run[-1][1]) >= GAP_BYTES:
            ranges.append(_Range(file, run))
            run = []
        run.append(item)
    if run:
        ranges.append(_Range(file, run))
    return ranges


class RangeReads:
    """Planned, coalesced reads of the segments ``chunks`` lists from the open kvstore
    ``kv`` (rooted at the checkpoint's ``data/``); ``file_bytes``: each data file's size."""

    def __init__(self, kv, chunks: dict[str, _index.Segment], file_bytes: dict[str, int]):
        self._kv = kv
        self._chunks = chunks
        self._file_bytes = file_bytes
        self._lock = threading.Lock()
        self._wanted: collections.Counter[str] = collections.Counter()  # not yet planned
        self._range_of: dict[str, _Range] = {}  # planned key -> its range
        self._left: collections.Counter[str] = collections.Counter()  # takes to come per key
        self._seq: dict[str, int] = {}  # key -> the order it was first wanted in
        self._queue: collections.deque[_Range] = collections.deque()  # planned, unstarted
        self._held_bytes = 0
        self.gets = 0  # GETs issued (a figure for tests and benchmarks)

    def want(self, keys) -> None:
        """Declares that chunks ``keys`` will be taken (once per listing)."""
        with self._lock:
            for key in keys:
                if key in self._chunks:
                    self._wanted[key] += 1
                    self._seq.setdefault(key, len(self._seq))

    def prefetch(self, keys) -> None:
        """As :meth:`want` (the name earlier callers use; their reads then wait through
        the deferred pool, which plans)."""
        self.want(keys)

    def plan(self) -> None:
        """Plans every key wanted since the last plan, and starts the fetches of its
        ranges in the order they are needed, as many as :data:`FETCH_BYTES` allows."""
        with self._lock:
            wanted, self._wanted = self._wanted, collections.Counter()
            by_file: dict[str, list] = collections.defaultdict(list)
            for key, times in wanted.items():
                self._left[key] += times
                if key in self._range_of:
                    self._range_of[key].left += times
                    continue
                segment = self._chunks[key]
                by_file[segment.file].append((segment.offset, segment.length, key))
            planned = []
            for file, items in by_file.items():
                items.sort()
                planned += plan_file(file, items, self._file_bytes.get(file, 0))
            planned.sort(key=lambda e: min(self._seq[key] for _, _, key in e.items))
            for entry in planned:
                self._add(entry)
            self._queue.extend(planned)
            self._start_ahead()

    def _start_ahead(self) -> None:
        """Starts queued ranges in order while they fit the bound. Under the lock."""
        while self._queue:
            entry = self._queue[0]
            if entry.future is not None or entry.left == 0:  # started, or split
                self._queue.popleft()
            elif not self._held_bytes or self._held_bytes + entry.nbytes <= FETCH_BYTES:
                self._issue(self._queue.popleft())
            else:
                break

    def _add(self, entry: _Range) -> None:
        entry.left = sum(self._left[key] for _, _, key in entry.items)
        for _, _, key in entry.items:
            self._range_of[key] = entry

    def take(self, key: str, segment: _index.Segment) -> bytes | memoryview | None:
        """The bytes of ``key``'s segment from its range (fetched now if not yet); None
        when no plan holds it, or its range came back short: the caller then reads the
        segment alone (and reports it missing where that fails too)."""
        with self._lock:
            entry = self._range_of.get(key)
            if entry is None or self._left[key] <= 0:
                return None
            if entry.future is None:
                entry = self._start(entry, key)
            self._left[key] -= 1
            if self._left[key] == 0:
                del self._range_of[key], self._left[key]
            entry.left -= 1
            if entry.left == 0:  # the last take: nothing more keeps its bytes
                self._held_bytes -= entry.nbytes
                self._start_ahead()
        lo = segment.offset - entry.start
        value = entry.bytes()[lo : lo + segment.length]
        return value if len(value) == segment.length else None

    def _start(self, entry: _Range, key: str) -> _Range:
        """Issues ``entry``'s GET, or, past the memory bound, that of a piece of it from
        ``key`` on (the rest stays planned). Under the lock."""
        if self._held_bytes and self._held_bytes + entry.nbytes > FETCH_BYTES:
            entry = self._split(entry, key)
        self._issue(entry)
        return entry

    def _issue(self, entry: _Range) -> None:
        if entry.whole is not None:
            entry.future = self._kv.read(entry.file)
        else:
            entry.future = self._kv.read(entry.file, byte_range=slice(entry.start, entry.stop))
        self._held_bytes += entry.nbytes
        self.gets += 1

    def _split(self, entry: _Range, key: str) -> _Range:
        keep = [item for item in entry.items if item[2] in self._range_of]
        at = next(i for i, item in enumerate(keep) if item[2] == key)
        piece = [keep[at]]
        for item in keep[at + 1 :]:
            if item[0] + item[1] - piece[0][0] > PIECE_BYTES or item[0] != sum(piece[-1][:2]):
                break
            piece.append(item)
        rest = plan_file(entry.file, keep[:at] + keep[at + len(piece) :], 0)
        entry.left = 0  # replaced by its parts: the queue drops it
        for part in [_Range(entry.file, piece), *rest]:
            self._add(part)
        self._queue.extendleft(reversed(rest))  # needed soon: first in line
        return self._range_of[key]
