"""Format version 2's data index: where each chunk of one process lies in its data files.

A process of a version-2 save writes every chunk of its arrays, and every shard of its
batches, into a few large data files ``data/<process>-<n>.bin`` of its item, one after
another, each segment the exact bytes a version-1 chunk file holds (the chunk and its
crc32c trailer; a batch shard with its checksummed index). ``data/<process>.json``
lists them: ``{key: [file number, offset, length, crc32c]}``, the key being the
version-1 file name of the chunk (``d/<i>/c/<i0>/...``, ``b/<batch>/c/<s>``) and the
crc32c a copy of the segment's last four bytes (little endian), and, for every array
and batch it holds chunks of, the dtype the bytes were written as (``arrays``: what a
version-1 ``zarr.json`` says, so a metadata document whose dtype was changed is caught
before its bytes are reinterpreted). FORMAT.md, "Version 2".
Records are immutable; any thread.

The fetch plan of a version-2 restore on an object store: few GETs, bounded memory.

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
import dataclasses
import re
import threading
from typing import Any

from .._errors import CorruptCheckpointError
from .._format import steps as _documents
from .._storage import local_files as _docs
from .._storage.location import Location

INDEX_FORMAT = "flax_orbax_plugin/data"
DATA_DIR = "data"
MAX_SEGMENT_BYTES = 1 << 50
_DATA_FILE = re.compile(r"^(0|[1-9][0-9]{0,8})-(0|[1-9][0-9]{0,8})\.bin$", re.ASCII)
_KEY = re.compile(r"^(d/(0|[1-9][0-9]*)|b/[A-Za-z0-9][A-Za-z0-9_.-]*)/c(/(0|[1-9][0-9]*))+$")
_ARRAY = re.compile(r"^(d/(0|[1-9][0-9]*)|b/[A-Za-z0-9][A-Za-z0-9_.-]*)$")
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def index_name(process: int) -> str:
    """The index file of ``process`` inside the item (``data/<process>.json``)."""
    return f"{DATA_DIR}/{int(process)}.json"


def data_file_name(process: int, number: int) -> str:
    """The name of data file ``number`` of ``process`` inside ``data/``."""
    return f"{int(process)}-{int(number)}.bin"


def array_prefix(key: str) -> str:
    """``d/<i>`` or ``b/<batch>``: the array a chunk key belongs to."""
    return key[: key.index("/c/")]


@dataclasses.dataclass(frozen=True)
class Segment:
    """One chunk inside a data file: ``file`` (its name inside ``data/``), the byte
    ``offset`` and ``length`` there, and the crc32c its last four bytes hold."""

    file: str
    offset: int
    length: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class DataIndex:
    """The index of one process: its data files (name -> size in bytes), chunks, and
    the stored dtype of every array it holds chunks of (``d/<i>`` or ``b/<batch>`` ->
    dtype name; empty in an index written before dtypes were recorded)."""

    process: int
    files: dict[str, int]
    chunks: dict[str, Segment]
    arrays: dict[str, str] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        names = list(self.files)
        number = {name: n for n, name in enumerate(names)}
        return {
            "format": INDEX_FORMAT,
            "format_version": 2,
            "process": self.process,
            "files": [{"name": name, "bytes": self.files[name]} for name in names],
            "chunks": {
                key: [number[s.file], s.offset, s.length, s.crc32c]
                for key, s in sorted(self.chunks.items())
            },
            "arrays": dict(sorted(self.arrays.items())),
        }

    @classmethod
    def from_json(cls, obj: Any, where: str, process: int) -> DataIndex:
        """Validates every field (names, numbers, ranges) before anything is used."""

        def bad(field: str, expected: str, found: Any):
            shown = repr(found)[:80]
            raise CorruptCheckpointError(
                f"{where}: field {field}: expected {expected}, found {shown}"
            )

        if not isinstance(obj, dict) or obj.get("format") != INDEX_FORMAT:
            bad("format", repr(INDEX_FORMAT), obj.get("format") if isinstance(obj, dict) else obj)
        if obj.get("format_version") != 2:
            bad("format_version", "2", obj.get("format_version"))
        if obj.get("process") != process or isinstance(obj.get("process"), bool):
            bad("process", str(process), obj.get("process"))
        files = _files(obj.get("files"), process, bad)
        names = list(files)
        raw = obj.get("chunks")
        if not isinstance(raw, dict):
            bad("chunks", "an object", raw)
        chunks = {}
        for key, entry in raw.items():
            if not isinstance(key, str) or not _KEY.match(key):
                bad("chunks", "keys d/<leaf>/c/<i>/... or b/<batch>/c/<i>", key)
            if not (
                isinstance(entry, list)
                and len(entry) == 4
                and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
            ):
                bad(f"chunks[{key!r}]", "[file, offset, length, crc32c] (integers)", entry)
            number, offset, length, crc = entry
            if not 0 <= number < len(names):
                bad(f"chunks[{key!r}][0]", f"a file number below {len(names)}", number)
            if not (0 <= offset and 4 < length <= MAX_SEGMENT_BYTES and 0 <= crc < 1 << 32):
                bad(f"chunks[{key!r}]", "offset >= 0, 4 < length, a 32-bit crc32c", entry)
            name = names[number]
            if offset + length > files[name]:
                bad(f"chunks[{key!r}]", f"a segment inside {name} ({files[name]} bytes)", entry)
            chunks[key] = Segment(name, offset, length, crc)
        _check_disjoint(chunks, where)
        return cls(process, files, chunks, _array_chunks(obj.get("arrays", {}), chunks, bad))


def read_index(
    location: Location, process: int, *, listed: dict[str, str] | None = None
) -> DataIndex:
    """The data index of ``process`` in the version-2 checkpoint at ``location``: its
    bytes checked against the sha256 the commit recorded (``listed``: those checksums,
    when the commit was read already), parsed as a data index (no
    key twice: ``json_docs``) and validated (:meth:`DataIndex.from_json`). Every reader
    of an index (restore, verify, incremental reuse, the tier) reads it here."""
    name = index_name(process)
    where = f"{location}/{name}"
    raw = _documents.read_listed(location, name, listed=listed)
    return DataIndex.from_json(_docs.parse(raw, where, _docs.DATA_INDEX), where, process)


def _check_disjoint(chunks: dict[str, Segment], where: str) -> None:
    """Segments do not overlap (FORMAT.md): two keys sharing bytes would restore one
    chunk's bytes as another's, each passing its crc32c."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for key, s in chunks.items():
        by_file.setdefault(s.file, []).append((s.offset, s.offset + s.length, key))
    for name, spans in by_file.items():
        spans.sort()
        for (a, b, k1), (c, d, k2) in zip(spans, spans[1:], strict=False):
            if c < b:
                raise CorruptCheckpointError(
                    f"{where}: field chunks: segments of {k1!r} (bytes {a}..{b}) and "
                    f"{k2!r} (bytes {c}..{d}) overlap in {DATA_DIR}/{name}; segments are "
                    f"disjoint"
                )


def _files(raw: Any, process: int, bad) -> dict[str, int]:
    if not isinstance(raw, list):
        bad("files", "a list", raw)
    files: dict[str, int] = {}
    for n, item in enumerate(raw):
        name = item.get("name") if isinstance(item, dict) else None
        size = item.get("bytes") if isinstance(item, dict) else None
        m = _DATA_FILE.match(name) if isinstance(name, str) else None
        if m is None or int(m.group(1)) != process or name in files:
            bad(f"files[{n}].name", f"a new name <{process}>-<n>.bin", name)
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= 1 << 50:
            bad(f"files[{n}].bytes", "a size in bytes", size)
        files[name] = size
    return files


def _array_chunks(raw: Any, chunks: dict[str, Segment], bad) -> dict[str, str]:
    """The ``arrays`` field: ``{d/<i> or b/<batch>: dtype name}``, each an array this
    index lists chunks of (absent in indexes written before it: no dtype is known)."""
    if not isinstance(raw, dict):
        bad("arrays", "an object", raw)
    held = {array_prefix(key) for key in chunks}
    for key, dtype in raw.items():
        if not isinstance(key, str) or not _ARRAY.match(key) or key not in held:
            bad("arrays", "keys d/<leaf> or b/<batch> of arrays with chunks listed", key)
        if not isinstance(dtype, str) or not _DTYPE.match(dtype):
            bad(f"arrays[{key!r}]", "a dtype name", dtype)
    return dict(raw)


def merge_dtypes(indexes: list[DataIndex], where: str) -> dict[str, str]:
    """Every process's stored dtypes in one mapping; two processes naming different
    dtypes for one array is damage."""
    out: dict[str, str] = {}
    for index in indexes:
        for key, dtype in index.arrays.items():
            if out.setdefault(key, dtype) != dtype:
                raise CorruptCheckpointError(
                    f"{where}: array {key}: the data indexes record dtype {out[key]!r} "
                    f"and {dtype!r}"
                )
    return out


def merge(indexes: list[DataIndex], where: str) -> dict[str, Segment]:
    """Every process's chunks in one mapping; a chunk listed twice is damage."""
    out: dict[str, Segment] = {}
    for index in indexes:
        for key, segment in index.chunks.items():
            if key in out:
                raise CorruptCheckpointError(
                    f"{where}: chunk {key} is listed by two processes' data indexes"
                )
            out[key] = segment
    return out


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

    def __init__(self, kv, chunks: dict[str, Segment], file_bytes: dict[str, int]):
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

    def take(self, key: str, segment: Segment) -> bytes | memoryview | None:
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
