"""Reading format version 2: the data indexes read back and checked, chunks at known offsets
in the data files, and the fetch plan of a restore on an object store.

``PackedReader`` threads as ``ChunkReader``; ``RangeReads`` is thread-safe (one lock).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.packed_reader``.
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
import re
import stat
import threading
from typing import Any

import numpy as np
import tensorstore as ts

from .._base import env as _env
from .._base import host as _host
from .._errors import CorruptCheckpointError
from .._format import layout as _layout
from .._format import steps as _steps
from .._storage import contexts as _contexts
from .._storage import local_files as _local_files
from .._storage.location import Location
from . import arrays as _arrays
from . import chunk_files as _chunk_files
from . import chunks as _chunks
from .chunks import (
    DATA_DIR,
    INDEX_FORMAT,
    MAX_SEGMENT_BYTES,
    DataIndex,
    Segment,
    array_prefix,
    index_name,
)


class PackedReader(_chunk_files.ChunkReader):
    """Reads the chunks ``chunks`` (every process's merged index) lists from the data files."""

    packed = True

    def __init__(
        self,
        location: Location,
        chunks: dict[str, _chunks.Segment],
        file_bytes: dict[str, int] | None = None,
        dtypes: dict[str, str] | None = None,
    ):
        super().__init__("")
        self.dtypes = dtypes or {}  # array (d/<i>, b/<batch>) -> dtype its bytes were written as
        self._fill = self._fill_segment
        self._where = self.where  # damage names the data file, not version 1's chunk file
        self._location = location
        self._chunks = chunks
        self._fds: dict[str, int] = {}
        self._kv = None
        self._ranges: RangeReads | None = None
        self._claimed: dict[str, tuple[int, int]] | None = None
        self._file_bytes = file_bytes or {}
        if location.is_local:
            self._ranged = self._ranged_segment  # parts of a segment (read_batch_range)
            try:
                for name in sorted({s.file for s in chunks.values()}):
                    self._fds[name] = self._open(name, chunks)
            except BaseException:
                self.close()
                raise
        else:
            spec = location.kvstore(_chunks.DATA_DIR)
            self._kv = ts.KvStore.open(spec, context=_contexts.context(local=False)).result()
            self._ranged = None  # object stores: whole segments, through the fetch plan
            self._ranges = RangeReads(self._kv, chunks, file_bytes or {})
            self._pool = _DeferredPool(self._pool, self._ranges, chunks)
            self._batch_pool = _DeferredPool(self._batch_pool, self._ranges, chunks)

    def _open(self, name: str, chunks) -> int:
        path = os.path.join(self._location.path, _chunks.DATA_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                raise ValueError(
                    f"data file {_chunks.DATA_DIR}/{name} cannot be opened: {e}"
                ) from None
            raise
        st = os.fstat(fd)
        end = max(s.offset + s.length for s in chunks.values() if s.file == name)
        if not stat.S_ISREG(st.st_mode) or st.st_size < end:
            os.close(fd)
            raise ValueError(
                f"data file {_chunks.DATA_DIR}/{name}: expected a regular file of at least "
                f"{end} bytes, found {st.st_size}"
            )
        return fd

    def read_batch(self, sub, size, chunk, inner, dtype, files=None):
        if self._kv is not None:
            numbers = range(-(-size // chunk)) if files is None else files
            self._ranges.want(_key(sub, (s,)) for s in numbers)
        read = super().read_batch(sub, size, chunk, inner, dtype, files)
        read.deferred = self._kv is not None
        return read

    def file_lengths(self) -> dict[str, tuple[int, int]]:
        """``{data file: (its length, the length its index records)}``; local only."""
        return {
            f"{_chunks.DATA_DIR}/{name}": (os.fstat(fd).st_size, self._file_bytes.get(name, -1))
            for name, fd in self._fds.items()
        }

    def close(self) -> None:
        super().close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def claimed(self, prefix: str) -> tuple[int, int]:
        """(chunks, bytes) the indexes list under the array ``prefix`` (``d/<i>``)."""
        if self._claimed is None:
            self._claimed = {}
            for key, segment in self._chunks.items():
                array = _chunks.array_prefix(key)
                n, b = self._claimed.get(array, (0, 0))
                self._claimed[array] = (n + 1, b + segment.length)
        return self._claimed.get(prefix, (0, 0))

    @property
    def reads_ranges(self) -> bool:
        return self._ranged is not None

    def where(self, path: str) -> str:
        seg = self._chunks.get(path)
        if seg is None:
            return f"chunk {path} (no data index lists it)"
        end = seg.offset + seg.length - 1
        return f"data file {_chunks.DATA_DIR}/{seg.file}, bytes {seg.offset}-{end} (chunk {path})"

    def _segment(self, path: str, expected: int) -> _chunks.Segment:
        _env.fail_point("read_chunk")  # as version 1's reader, before each chunk read
        segment = self._chunks.get(path)
        if segment is None:
            raise ValueError(f"chunk {path} is missing (no data index lists it)")
        if segment.length != expected:
            raise ValueError(
                f"chunk {path}: expected {expected} bytes, its data index lists {segment.length}"
            )
        return segment

    def _ranged_segment(self, path: str, name: str, expected: int, ranges: list) -> None:
        """Fills each ``(offset in the segment, parts)`` of ``ranges``, its crc32c checked."""
        segment = self._segment(path, expected)
        label = f"{path} ({_chunks.DATA_DIR}/{segment.file} at {segment.offset})"
        total = 0
        for offset, parts in ranges:
            at = _chunk_files.preadv_into(
                self._fds[segment.file], parts, segment.offset + offset, label
            )
            total += at - segment.offset - offset
        _chunk_files.count_read(total)
        last = ranges[-1][1][-1]
        if (
            int.from_bytes(last.tobytes(), "little") != segment.crc32c
            or at != segment.offset + expected
        ):
            raise ValueError(f"chunk {label}: its crc32c differs from its data index's")

    def _fill_segment(self, path: str, name: str, parts: list[np.ndarray]) -> None:
        expected = sum(p.size for p in parts)
        if self._kv is None:  # local: the whole segment as one range
            return self._ranged_segment(path, name, expected, [(0, parts)])
        segment = self._segment(path, expected)
        where = f"{path} ({_chunks.DATA_DIR}/{segment.file} at {segment.offset})"
        value = self._ranges.take(path, segment)
        if value is None:
            stop = segment.offset + segment.length
            result = self._kv.read(segment.file, byte_range=slice(segment.offset, stop)).result()
            if result.state != "value" or len(result.value) != expected:
                raise ValueError(f"chunk {where}: missing or short")
            value = result.value
        raw = np.frombuffer(value, np.uint8)
        at = 0
        for p in parts:
            p[...] = raw[at : at + p.size]
            at += p.size
        if int.from_bytes(parts[-1].tobytes(), "little") != segment.crc32c:
            raise ValueError(f"chunk {where}: its crc32c differs from its data index's")

    def read(self, sub, shape, chunk, dtype, region=None) -> _chunk_files.PendingRead:
        """Starts reading ``region`` (None: all) of array ``sub``; on an object store its
        jobs start at the first wait, so the fetch plan knows every read issued before."""
        bounds, ranges = _cells(shape, chunk, region)
        if self._kv is not None:
            self._ranges.want(_key(sub, cell) for cell in itertools.product(*ranges))
        read = super().read(sub, shape, chunk, dtype, region)
        if read is None:
            read = self._read_cut(sub, chunk, dtype, bounds, ranges)
        read.deferred = self._kv is not None
        return read

    def _read_cut(self, sub, chunk, dtype, bounds, ranges) -> _chunk_files.PendingRead:
        """A region that cuts chunks: each read whole, its part copied."""
        read = _chunk_files.PendingRead(tuple(b - a for a, b in bounds), dtype)
        for cell in itertools.product(*ranges):
            src, dst = [], []
            for i, c, (a, b) in zip(cell, chunk, bounds, strict=True):
                lo, hi = max(a, i * c), min(b, i * c + c)
                src.append(slice(lo - i * c, hi - i * c))
                dst.append(slice(lo - a, hi - a))
            args = (_key(sub, cell), read.out[tuple(dst)], tuple(chunk), self._scratch, tuple(src))
            job = self._pool.submit(_chunk_files._read_chunk_copy, *args, **self._fill_kw())
            read.futures.append(job)
        return read

    def read_compressed(self, index: int, record, region=None) -> CompressedRead:
        """Starts reading ``region`` (None: all) of leaf ``index``'s compressed array."""
        sub, chunk = _layout.array_dir(index), record.storage.chunk_shape
        _, ranges = _cells(record.shape, chunk, region)
        keys = [_key(sub, cell) for cell in itertools.product(*ranges)]
        decoder = _arrays.Decoder(_arrays.leaf_spec(_arrays.MEMORY, index, record))
        raw = int(np.prod(chunk, dtype=np.int64)) * decoder.store.dtype.numpy_dtype.itemsize
        view = decoder.store if region is None else decoder.store[tuple(region)]
        dtype = _layout.dtype_from_name(record.dtype, path=record.path)
        return CompressedRead(self._load_all(sub, keys, decoder, raw, 1), view, dtype)

    def compressed_batch(self, batch):
        """``batch`` (compressed) as a tensorstore array, every shard checked; else None."""
        if batch.codec is None:
            return None
        chunk, inner = int(batch.chunk), batch.inner
        raw = chunk * _layout.dtype_from_name(batch.dtype).itemsize
        sub = _layout.batch_dir(batch.name)
        decoder = _arrays.Decoder(_arrays.batch_spec(_arrays.MEMORY, batch))
        keys = [_key(sub, (s,)) for s in range(-(-batch.size // chunk))]
        for future in self._load_all(sub, keys, decoder, raw, chunk // inner):
            future.result()
        return decoder.store

    def _load_all(self, sub, keys, decoder, raw: int, inners: int) -> list:
        if self._kv is not None:
            self._ranges.want(keys)
        bound = _arrays.max_segment_bytes(raw, inners)
        return [self._pool.submit(self._load, sub, key, decoder, bound) for key in keys]

    def _load(self, sub: str, key: str, decoder, bound: int) -> None:
        segment = self._chunks.get(key)
        if segment is None:
            raise ValueError(f"chunk {key} is missing (no data index lists it)")
        if segment.length > bound:
            raise ValueError(
                f"chunk {key}: its data index lists {segment.length} bytes, more than a "
                f"compressed chunk can hold ({bound})"
            )
        raw = np.empty(segment.length, np.uint8)  # body, then the trailer checked
        self._fill_segment(key, key, [raw[: -_chunks.CRC_BYTES], raw[-_chunks.CRC_BYTES :]])
        decoder.put(key[len(sub) + 1 :], raw)


class CompressedRead:
    """A read of a compressed array: its segments being fetched, then the decode."""

    def __init__(self, futures: list, view, dtype: np.dtype):
        self.futures = futures
        self.view = view
        self.dtype = dtype  # the leaf's (the array's own may be a stand-in)

    def result(self) -> np.ndarray:
        for future in self.futures:
            future.result()
        out = _host.empty(self.view.shape, self.dtype)
        into = _arrays.as_stored(out, self.view.dtype.numpy_dtype)
        ts.array(into, copy=False).write(self.view).result()
        return out


def _cells(shape, chunk, region) -> tuple[list[tuple[int, int]], list[range]]:
    """Per axis, the bounds of ``region`` (None: all) and the chunk indices it touches."""
    bounds = [
        s.indices(n)[:2] for s, n in zip(region or [slice(None)] * len(shape), shape, strict=True)
    ]
    return bounds, [range(a // c, -(-b // c)) for (a, b), c in zip(bounds, chunk, strict=True)]


def _key(sub: str, cell) -> str:
    return "/".join([sub, *_chunks.chunk_parts(cell)]) if cell else f"{sub}/c"


_DATA_FILE = re.compile(r"^(0|[1-9][0-9]{0,8})-(0|[1-9][0-9]{0,8})\.bin$", re.ASCII)
_KEY = re.compile(r"^(d/(0|[1-9][0-9]*)|b/[A-Za-z0-9][A-Za-z0-9_.-]*)/c(/(0|[1-9][0-9]*))+$")
_ARRAY = re.compile(r"^(d/(0|[1-9][0-9]*)|b/[A-Za-z0-9][A-Za-z0-9_.-]*)$")
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def index_from_json(obj: Any, where: str, process: int) -> DataIndex:
    def bad(field: str, expected: str, found: Any):
        shown = repr(found)[:80]
        raise CorruptCheckpointError(f"{where}: field {field}: expected {expected}, found {shown}")

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
    return DataIndex(process, files, chunks, _array_chunks(obj.get("arrays", {}), chunks, bad))


def read_index(
    location: Location, process: int, *, listed: dict[str, str] | None = None
) -> DataIndex:
    """The data index of ``process`` at ``location``, checked against its commit's sha256."""
    name = index_name(process)
    where = f"{location}/{name}"
    if listed is None:
        listed = _steps.listed_checksums(location)
    raw = _layout.read_listed(location, name, listed=listed)
    return index_from_json(_local_files.parse(raw, where, _local_files.DATA_INDEX), where, process)


def _check_disjoint(chunks: dict[str, Segment], where: str) -> None:
    """Segments do not overlap (FORMAT.md): shared bytes would pass as two chunks' crc32c."""
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
    """The ``arrays`` field: ``{d/<i> or b/<batch>: dtype name}`` (absent in older indexes)."""
    if not isinstance(raw, dict):
        bad("arrays", "an object", raw)
    held = {array_prefix(key) for key in chunks}
    for key, dtype in raw.items():
        if not isinstance(key, str) or not _ARRAY.match(key) or key not in held:
            bad("arrays", "keys d/<leaf> or b/<batch> of arrays with chunks listed", key)
        if not isinstance(dtype, str) or not _DTYPE.match(dtype):
            bad(f"arrays[{key!r}]", "a dtype name", dtype)
    return dict(raw)


def merge(indexes: list[DataIndex], where: str) -> tuple[dict[str, Segment], dict[str, str]]:
    """Every process's chunks and dtypes, merged; a chunk listed twice or two dtypes is damage."""
    chunks: dict[str, Segment] = {}
    dtypes: dict[str, str] = {}
    for index in indexes:
        for key, segment in index.chunks.items():
            if chunks.setdefault(key, segment) is not segment:
                raise CorruptCheckpointError(
                    f"{where}: chunk {key} is listed by two processes' data indexes"
                )
        for key, dtype in index.arrays.items():
            if dtypes.setdefault(key, dtype) != dtype:
                raise CorruptCheckpointError(
                    f"{where}: array {key}: the data indexes record dtype {dtypes[key]!r} "
                    f"and {dtype!r}"
                )
    return chunks, dtypes


def open_packed(
    location: Location, process_count: int, *, listed: dict[str, str] | None = None
) -> PackedReader:
    """A reader of the version-2 checkpoint at ``location`` over every process's index."""
    indexes = [read_index(location, process, listed=listed) for process in range(process_count)]
    sizes = {name: size for index in indexes for name, size in index.files.items()}
    chunks, dtypes = merge(indexes, str(location))
    return PackedReader(location, chunks, sizes, dtypes)


AHEAD_BYTES = 64 << 20  # object stores: chunk jobs started ahead of the one waited for


class _Job:
    """A chunk job on an object store, started when it or a later job is waited for."""

    def __init__(self, pool: _DeferredPool, call: tuple, kwargs: dict):
        self._pool = pool
        self.call = call
        self.kwargs = kwargs
        self.future = None

    def result(self):
        if self.future is None:
            self._pool.start_through(self)
        return self.future.result()


class _DeferredPool:
    """The reader's pool on an object store: jobs queue until one is waited for; then the
    plan is made and the jobs up to it and :data:`AHEAD_BYTES` after start. Calling thread."""

    def __init__(self, pool, ranges: RangeReads, chunks: dict[str, _chunks.Segment]):
        self._pool = pool
        self._ranges = ranges
        self._chunks = chunks
        self._queue: collections.deque[_Job] = collections.deque()

    def submit(self, fn, *args, **kwargs) -> _Job:
        job = _Job(self, (fn, *args), kwargs)
        self._queue.append(job)
        return job

    def start_through(self, job: _Job) -> None:
        self._ranges.plan()
        ahead = 0
        while self._queue:
            if job.future is not None:  # past the one waited for: read ahead, bounded
                segment = self._chunks.get(self._queue[0].call[1])
                ahead += segment.length if segment is not None else 0
                if ahead > AHEAD_BYTES:
                    break
            nxt = self._queue.popleft()
            nxt.future = self._pool.submit(*nxt.call, **nxt.kwargs)

    def shutdown(self, **kwargs) -> None:
        self._queue.clear()
        self._pool.shutdown(**kwargs)


GAP_BYTES = 1 << 20  # a gap under this between wanted segments is fetched with them
WHOLE_FRACTION = 0.75  # this share of a data file wanted: the whole object, one GET
FETCH_BYTES = 1 << 30  # at most this many fetched bytes held at once (see above)
PIECE_BYTES = 64 << 20  # the most a range split for the memory bound fetches


class _Range:
    """Wanted segments ``items`` [(offset, length, key)] of data file ``file``: one GET."""

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
        """The fetched bytes (empty: no object), taken once (each ``.value`` is a fresh copy)."""
        with self.lock:
            if self.value is None:
                result = self.future.result()
                self.value = memoryview(result.value if result.state == "value" else b"")
            return self.value

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def plan_file(file: str, items: list, size: int) -> list[_Range]:
    """The ranges fetching ``items`` [(offset, length, key)], sorted, of ``file`` (``size``)."""
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
    """Planned, coalesced reads of the segments ``chunks`` lists from the kvstore ``kv``."""

    def __init__(self, kv, chunks: dict[str, _chunks.Segment], file_bytes: dict[str, int]):
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

    def plan(self) -> None:
        """Plans the keys wanted since; starts their ranges in order, within :data:`FETCH_BYTES`."""
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

    def take(self, key: str, segment: _chunks.Segment) -> bytes | memoryview | None:
        """The bytes of ``key``'s segment from its range; None: the caller reads it alone."""
        with self._lock:
            entry = self._range_of.get(key)
            if entry is None or self._left[key] <= 0:
                return None
            if entry.future is None:  # past the memory bound: a piece of it, from key on
                if self._held_bytes and self._held_bytes + entry.nbytes > FETCH_BYTES:
                    entry = self._split(entry, key)
                self._issue(entry)
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
