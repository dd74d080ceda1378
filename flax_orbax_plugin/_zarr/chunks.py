"""One zarr3 chunk on disk (name, bytes, crc32c trailer), packed sub-byte arrays, and format
version 2's data index.

Pure functions and immutable records: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.chunks``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import CheckpointError, CorruptCheckpointError
from .._format import steps as _steps
from .._format.layout import DTYPES, ArrayStorage, LeafRecord, dtype_from_name
from .._storage import local_files as _local_files
from .._storage.location import Location

try:
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - the fallback: holds the GIL on numpy buffers
    import google_crc32c

    def _crc32c(data, value: int = 0) -> int:
        return google_crc32c.extend(value, data)

    GIL_FREE_CRC = False
else:
    GIL_FREE_CRC = True

try:  # the optional C extension (setup.py): copies and checksums in one pass
    from . import _copycrc
except ImportError:  # not built (no compiler): np.copyto, then the crc32c above
    _copycrc = None

THREADS = 8  # as tensorstore's file_io_concurrency for local disks (_storage.context)
CHUNK_DIR = "c"  # zarr3 default chunk key encoding: c/<i0>/<i1>/...
CRC_BYTES = 4  # the crc32c codec's trailer, little endian
CRC32C_RESIDUE = 0x48674BC7  # crc32c of any message followed by its own crc32c (LE)
MISSING_ENTRY = (1 << 64) - 1  # a shard index entry for an inner chunk that is not stored
IOV_MAX = 1000  # below the kernel's 1024 buffers per writev


def chunk_parts(cell) -> tuple[str, ...]:
    """The path parts of chunk grid cell ``cell`` under its array's directory."""
    return (CHUNK_DIR, *map(str, cell))


def chunk_key(cell) -> str:
    """``c/<i0>/<i1>/...``: the key of chunk grid cell ``cell`` under its array."""
    return "/".join(chunk_parts(cell))


def file_name(path: str) -> str:
    """A version-1 chunk or batch file's name in errors: ``<array>/c/...`` (4 parts)."""
    return "/".join(path.split(os.sep)[-4:])


def stored_name(path: str, where: Callable[[str], str] | None, kind: str) -> str:
    """The words naming the stored bytes of chunk ``path`` in a damage error: the file
    of the format that wrote them (``where(path)``: a version-2 data file and its byte
    range), else version 1's own file (``<kind> <array>/c/...``)."""
    return where(path) if where is not None else f"{kind} {file_name(path)}"


def extend_crc(crc: int, data) -> int:
    """crc32c of the bytes so far (``crc``) followed by ``data`` (any C-contiguous
    buffer: bytes, memoryview, a numpy array of any dtype)."""
    return _crc32c(data, crc)


def whole_chunks(shape, chunk, index):
    """For the region ``index`` (global) of an array of ``shape``: (the region's shape,
    [(chunk grid cell, the cell's part of the region, relative to it), ...]); None when
    the region is empty or not whole chunks (a chunk cut by the array's end counts as
    whole)."""
    if not shape:
        return None
    starts, stops = [], []
    for s, n, c in zip(index, shape, chunk, strict=True):
        start, stop, step = s.indices(n)
        if step != 1 or start >= stop or start % c or (stop % c and stop != n):
            return None
        starts.append(start)
        stops.append(stop)
    cells = []
    ranges = [range(a // c, -(-b // c)) for a, b, c in zip(starts, stops, chunk, strict=True)]
    for cell in itertools.product(*ranges):
        at = []
        for i, c, n, start in zip(cell, chunk, shape, starts, strict=True):
            at.append(slice(i * c - start, min(i * c + c, n) - start))
        cells.append((cell, tuple(at)))
    return tuple(b - a for a, b in zip(starts, stops, strict=True)), cells


def crc_trailer(parts: list[np.ndarray]) -> np.ndarray:
    """The zarr3 ``crc32c`` codec's trailer of the bytes of ``parts`` one after another
    (C-contiguous arrays), as 4 uint8."""
    crc = 0
    for part in parts:
        crc = _crc32c(as_bytes(part), crc)
    return np.frombuffer(crc.to_bytes(CRC_BYTES, "little"), np.uint8)


def crc_matches(parts: list[np.ndarray], trailer: np.ndarray) -> bool:
    return np.array_equal(crc_trailer(parts), trailer)


def chunk_payload(view: np.ndarray, chunk: tuple[int, ...]) -> np.ndarray:
    """The stored bytes of one chunk (before its crc32c) from ``view``, the chunk's
    part of the array: zero-padded to the full ``chunk`` where the array's end cuts
    it, as tensorstore pads it."""
    if view.shape != chunk:  # cut by the array's end: zero-padded to the full chunk
        full = np.zeros(chunk, view.dtype)
        full[tuple(slice(0, n) for n in view.shape)] = view
        view = full
    elif not view.flags.c_contiguous:
        view = np.ascontiguousarray(view)
    return as_bytes(view)


def chunk_crcs(
    shape: tuple[int, ...], chunk: tuple[int, ...], index: tuple[slice, ...], data: np.ndarray
) -> dict[tuple[int, ...], int] | None:
    """``{chunk grid cell: crc32c}`` of every chunk of the region ``index`` (global) of
    an array of ``shape`` holding ``data`` (that region's values): the value the
    zarr3 ``crc32c`` codec stores as the trailer of each chunk file that
    :meth:`ChunkWriter.array` (or tensorstore) writes for it, computed over the same
    bytes (little endian, edge chunks zero-padded). None when the region is not whole
    chunks. A 0-d array is one chunk, cell ``()``. Any thread; reads ``data`` only."""
    if data.dtype.byteorder == ">":  # the stored encoding is little endian
        data = data.astype(data.dtype.newbyteorder("<"))
    if not shape:
        if data.shape != ():
            return None
        return {
            (): int.from_bytes(
                crc_trailer([as_bytes(np.ascontiguousarray(data))]).tobytes(), "little"
            )
        }
    region = whole_chunks(shape, chunk, index)
    if region is None or data.shape != region[0]:
        return None
    return {
        cell: int.from_bytes(
            crc_trailer([chunk_payload(data[at], tuple(chunk))]).tobytes(), "little"
        )
        for cell, at in region[1]
    }


COPY_STEP = 256 << 10  # without the kernel: bytes copied, then checksummed, at a time


def has_kernel() -> bool:
    """Whether the C kernel of :func:`copy_crc` is built (and imported) here."""
    return _copycrc is not None


def copy_crc(dst: np.ndarray, src: np.ndarray, crc: int = 0, kernel: bool | None = None) -> int:
    """``dst[...] = src`` for flat uint8 arrays of one size (C-contiguous, not
    overlapping); returns the crc32c of those bytes continued from ``crc`` (as
    :func:`extend_crc`). ``kernel``: None, the C kernel where it is built; True, the
    kernel (RuntimeError where it is not); False, ``np.copyto`` then the crc32c,
    :data:`COPY_STEP` bytes at a time (each piece checksummed while still in cache).
    Any thread: both release the GIL on large buffers."""
    if kernel is None:
        kernel = _copycrc is not None
    if kernel:
        if _copycrc is None:
            raise RuntimeError(
                "copy_crc: the C kernel (flax_orbax_plugin._zarr._copycrc) is not built"
            )
        return _copycrc.copy_crc(dst, src, crc)
    for a in range(0, dst.size, COPY_STEP):
        np.copyto(dst[a : a + COPY_STEP], src[a : a + COPY_STEP])
        crc = _crc32c(dst[a : a + COPY_STEP], crc)
    return crc


def extend_zeros(crc: int, n: int) -> int:
    """crc32c of the bytes so far (``crc``) followed by ``n`` zero bytes."""
    if _copycrc is not None:
        return _copycrc.extend_zeros(crc, n)
    return _crc32c(np.zeros(n, np.uint8), crc) if n else crc


def copy_with_crcs(
    dst: np.ndarray,
    src: np.ndarray,
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    index: tuple[slice, ...],
    out: dict,
    kernel: bool | None = None,
) -> None:
    """``np.copyto(dst, src)``, checksumming in the same pass: ``dst`` and ``src`` hold
    the region ``index`` (global) of an array of ``shape`` chunked by ``chunk``; where
    it is whole chunks, each chunk's crc32c (the value :func:`chunk_crcs` gives, the
    trailer its file stores) is put in ``out`` (``{chunk grid cell: crc32c}``).

    A chunk spanning whole rows (its trailing axes the array's) is copied by
    :func:`copy_crc` (``kernel``: which way), which checksums every byte as it copies it
    (the C kernel), or right after it copies each piece, still in the core's cache;
    the zero padding of a chunk cut by the array's end is checksummed after it. Other
    chunks are copied, then checksummed. Nothing is put in ``out`` for a region that
    is not whole chunks, a 0-d or big-endian array: the writer computes those. Any
    thread (the copies and the crc32c release the GIL); distinct calls put distinct
    cells."""
    region = None if dst.dtype.byteorder == ">" else whole_chunks(shape, chunk, index)
    if region is None or dst.shape != region[0] or src.shape != dst.shape:
        np.copyto(dst, src)
        return
    for cell, at in region[1]:
        d, s = dst[at], src[at]
        if d.shape[1:] == tuple(chunk[1:]) and d.flags.c_contiguous and s.flags.c_contiguous:
            flat_d, flat_s = d.reshape(-1).view(np.uint8), s.reshape(-1).view(np.uint8)
            crc = copy_crc(flat_d, flat_s, 0, kernel)
            pad = (int(np.prod(chunk)) - d.size) * d.dtype.itemsize  # cut by the array's end
            crc = extend_zeros(crc, pad)
        else:
            np.copyto(d, s)
            crc = _crc32c(chunk_payload(d, tuple(chunk)))
        out[cell] = crc


def as_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat, read-only uint8 view (any dtype,
    ml_dtypes ones too; google_crc32c, the fallback crc, takes read-only buffers only)."""
    out = array.reshape(-1).view(np.uint8)
    out.flags.writeable = False
    return out


def advance(views: list[memoryview], done: int) -> None:
    """Drops ``done`` bytes from the front of ``views`` (a short read or write resumes
    mid-buffer)."""
    while done:
        if done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][done:]
            done = 0


def bits_of(dtype_name: str) -> int:
    return DTYPES[dtype_name].bits


def _nbytes(values: int, bits: int) -> int:
    return -(-values * bits // 8)


def is_packed(record: LeafRecord) -> bool:
    return isinstance(record.storage, ArrayStorage) and record.storage.packed


def stored(record: LeafRecord) -> LeafRecord:
    """``record`` as its zarr3 array stores it: itself, or for a packed leaf a ``uint8``
    record whose shape and chunk shape hold the packed bytes along the last axis."""
    if not is_packed(record):
        return record
    bits = bits_of(record.dtype)
    storage = record.storage
    shape = (*record.shape[:-1], _nbytes(record.shape[-1], bits))
    chunk = (*storage.chunk_shape[:-1], _nbytes(storage.chunk_shape[-1], bits))
    return dataclasses.replace(
        record,
        shape=shape,
        dtype="uint8",
        storage=dataclasses.replace(storage, chunk_shape=chunk, packed=False),
    )


def group(bits: int) -> int:
    """Values per group of whole bytes (4-bit: 2 in 1 byte; 2-bit: 4; 1-bit: 8; 6-bit: 4
    in 3 bytes): a row's groups start on bytes."""
    return 8 // math.gcd(bits, 8)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """``values`` (a sub-byte dtype, any shape of at least one axis) as packed rows:
    uint8 of shape ``(..., ceil(n * bits / 8))``."""
    low = np.ascontiguousarray(values).view(np.uint8) & np.uint8((1 << bits) - 1)
    n, g = low.shape[-1], group(bits)
    if n % g:
        pad = np.zeros((*low.shape[:-1], g - n % g), np.uint8)
        low = np.concatenate([low, pad], axis=-1)
    lanes = low.reshape(*low.shape[:-1], -1, g)
    wide = np.uint32 if g * bits > 8 else np.uint8
    word = np.zeros(lanes.shape[:-1], wide)
    for j in range(g):
        word |= lanes[..., j].astype(wide) << wide(j * bits)
    per = g * bits // 8  # bytes per group
    out = np.empty((*word.shape, per), np.uint8)
    for i in range(per):
        out[..., i] = word >> wide(8 * i) if per > 1 else word
    return out.reshape(*low.shape[:-1], -1)[..., : _nbytes(n, bits)]


def unpack_rows(packed: np.ndarray, bits: int, width: int, skip: int, dtype) -> np.ndarray:
    """Values ``skip .. skip + width`` of each row of ``packed`` (uint8 rows, each
    starting on a group): an array of ``dtype`` (one canonical byte each)."""
    packed = np.asarray(packed, np.uint8)
    g = group(bits)
    per = g * bits // 8
    if packed.shape[-1] % per:
        pad = np.zeros((*packed.shape[:-1], per - packed.shape[-1] % per), np.uint8)
        packed = np.concatenate([packed, pad], axis=-1)
    groups = packed.reshape(*packed.shape[:-1], -1, per)
    wide = np.uint32 if per > 1 else np.uint8
    word = groups[..., 0].astype(wide)
    for i in range(1, per):
        word |= groups[..., i].astype(wide) << wide(8 * i)
    mask = wide((1 << bits) - 1)
    out = np.empty((*word.shape, g), np.uint8)
    for j in range(g):
        out[..., j] = (word >> wide(j * bits)) & mask
    out = out.reshape(*packed.shape[:-1], -1)
    return np.ascontiguousarray(out[..., skip : skip + width]).view(dtype)


def pack_flat(values: np.ndarray) -> np.ndarray:
    """A small leaf's values (a sub-byte dtype) as one bit stream, C order: the bytes of
    its ``packed_batch`` slot (uint8, ``_format.layout.packed_bytes`` of them)."""
    flat = np.ascontiguousarray(values).reshape(-1)
    return pack_rows(flat, bits_of(flat.dtype.name))


def unpack_flat(data: np.ndarray, record: LeafRecord) -> np.ndarray:
    """The values of a ``packed_batch`` leaf from its slot's bytes (flat)."""
    count = math.prod(record.shape)
    dtype = dtype_from_name(record.dtype, path=record.path)
    return unpack_rows(np.asarray(data).reshape(-1), bits_of(record.dtype), count, 0, dtype)


def _last_axis(index, n: int) -> tuple[int, int]:
    start, stop, step = index[-1].indices(n)
    if step != 1:
        raise CheckpointError(f"a strided region {index} of a packed array")
    return start, stop


def pack_write(record: LeafRecord, index: tuple, data: np.ndarray) -> tuple[tuple, np.ndarray]:
    """One region (``index``, global, whole chunks) of a packed leaf and its values:
    the stored array's region and its bytes."""
    bits, n = bits_of(record.dtype), record.shape[-1]
    start, stop = _last_axis(index, n)
    if start * bits % 8 or (stop * bits % 8 and stop != n):
        raise CheckpointError(
            f"leaf {record.path!r}: a region {index} whose last axis is not on whole bytes "
            f"of its packed {record.dtype} chunks"
        )
    region = (*index[:-1], slice(start * bits // 8, _nbytes(stop, bits)))
    return region, pack_rows(np.asarray(data), bits)


class Unpacked:
    """A read of a packed leaf's stored bytes that gives the leaf's values."""

    def __init__(self, read: Any, record: LeafRecord, width: int, skip: int):
        self.read, self.bits = read, bits_of(record.dtype)
        self.width, self.skip = width, skip
        self.dtype = dtype_from_name(record.dtype, path=record.path)
        self.deferred = getattr(read, "deferred", False)

    def result(self) -> np.ndarray:
        return unpack_rows(self.read.result(), self.bits, self.width, self.skip, self.dtype)


def stored_region(record: LeafRecord, region) -> tuple[tuple, int, int]:
    """For a read of ``region`` (global; None: all) of a packed leaf: (the stored
    array's region holding it, from the byte of the group its first value is in; the
    values per row; the values to skip at each row's start)."""
    bits, n = bits_of(record.dtype), record.shape[-1]
    index = tuple(region) if region is not None else (slice(None),) * len(record.shape)
    start, stop = _last_axis(index, n)
    first = start - start % group(bits)
    inner = (*index[:-1], slice(first * bits // 8, _nbytes(stop, bits)))
    return inner, stop - start, start - first


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
    key twice: ``local_files``) and validated (:meth:`DataIndex.from_json`). Every reader
    of an index (restore, verify, incremental reuse, the tier) reads it here."""
    name = index_name(process)
    where = f"{location}/{name}"
    raw = _steps.read_listed(location, name, listed=listed)
    return DataIndex.from_json(
        _local_files.parse(raw, where, _local_files.DATA_INDEX), where, process
    )


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
