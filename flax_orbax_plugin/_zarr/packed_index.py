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
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from .._errors import CorruptCheckpointError
from .._format import documents as _documents
from .._storage import json_docs as _docs
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
