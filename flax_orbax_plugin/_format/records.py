"""Format version 1's records as a writer makes them: the dtypes (declared once), checked
JSON, bounds, the leaf and batch records, the names on disk, the commit records. Pure
functions over immutable records; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.records``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import math
import operator
import re
import reprlib
from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np

from .._errors import CorruptCheckpointError, StructureError
from .._storage import local_files as _local_files


@dataclasses.dataclass(frozen=True)
class Dtype:
    """One dtype a checkpoint may hold: numpy's ``name``, ``bits`` per value (under 8:
    sub-byte), its zarr3 ``data_type`` (else ``uint8``), its ``safetensors`` tag or None."""

    name: str
    bits: int
    zarr: str
    safetensors: str | None


def _table(rows: str) -> dict[str, Dtype]:
    out = {}
    for row in rows.strip().splitlines():
        name, bits, zarr, tag = row.split()
        zarr = name if zarr == "=" else zarr
        out[name] = Dtype(name, int(bits), zarr, None if tag == "-" else tag)
    return out


# name, bits, zarr3 data_type ("=": its own name), safetensors tag ("-": none). Every
# dtype jax.numpy offers (tests/format/test_every_dtype.py fails for one not listed).
DTYPES = _table(
    """
    bool                8   =       BOOL
    int1                1   uint8   -
    int2                2   =       -
    int4                4   =       -
    int8                8   =       I8
    int16               16  =       I16
    int32               32  =       I32
    int64               64  =       I64
    uint1               1   uint8   -
    uint2               2   uint8   -
    uint4               4   uint8   -
    uint8               8   =       U8
    uint16              16  =       U16
    uint32              32  =       U32
    uint64              64  =       U64
    float4_e2m1fn       4   =       F4
    float6_e2m3fn       6   uint8   F6_E2M3
    float6_e3m2fn       6   uint8   F6_E3M2
    float8_e3m4         8   =       -
    float8_e4m3         8   uint8   -
    float8_e4m3b11fnuz  8   =       -
    float8_e4m3fn       8   =       F8_E4M3
    float8_e4m3fnuz     8   =       F8_E4M3FNUZ
    float8_e5m2         8   =       F8_E5M2
    float8_e5m2fnuz     8   =       F8_E5M2FNUZ
    float8_e8m0fnu      8   =       F8_E8M0
    float16             16  =       F16
    bfloat16            16  =       BF16
    float32             32  =       F32
    float64             64  =       F64
    complex64           64  =       C64
    complex128          128 =       -
    """
)


SUPPORTED_DTYPES = frozenset(DTYPES)
# The dtypes numpy itself has; every other one is ml_dtypes', imported at the first
# such dtype resolved (0.3-0.9 s: a command that reads only JSON never pays it).
NUMPY_NATIVE = frozenset(
    "bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
    "complex64 complex128".split()
)


@functools.lru_cache(maxsize=256)
def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached (numpy computes it anew on every access)."""
    return dtype.name


@functools.lru_cache(maxsize=64)
def dtype_from_name(name: str, *, path: str = "?") -> np.dtype:
    """numpy dtype for a stored dtype name; a clear error for unknown names."""
    if name not in SUPPORTED_DTYPES:
        raise StructureError(
            f"leaf {path!r}: unknown dtype {name!r} (expected one of {sorted(SUPPORTED_DTYPES)})"
        )
    if name in NUMPY_NATIVE:
        return np.dtype(name)
    return np.dtype(getattr(importlib.import_module("ml_dtypes"), name))


def packable(name: str, shape, chunk) -> bool:
    """Whether a leaf of dtype ``name``, ``shape`` and ``chunk`` is stored packed (FORMAT.md)."""
    bits = DTYPES[name].bits
    if bits >= 8 or not shape or 0 in shape:
        return False
    return chunk[-1] == shape[-1] or chunk[-1] * bits % 8 == 0


def packed_bytes(name: str, count: int) -> int:
    """Bytes of ``count`` values of a sub-byte dtype packed into one bit stream."""
    return -(-count * DTYPES[name].bits // 8)


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", re.ASCII)
_SHA256 = re.compile(r"^[0-9a-f]{64}$", re.ASCII)


def is_safe_name(name: Any) -> bool:
    """A name usable as one path component: letters, digits, '_', '-', '.'; no '..'."""
    return isinstance(name, str) and bool(_SAFE_NAME.match(name)) and ".." not in name


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(obj: Any) -> bytes:
    """Compact, deterministic JSON bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def seal(body: dict[str, Any], kind: _local_files.DocKind | None = None) -> bytes:
    """JSON bytes of ``body`` plus its ``checksum``; with ``kind``, bounded as its reader's."""
    sealed = dict(body, checksum=sha256(encode(body)))
    if kind is None:
        return encode(sealed)
    return _local_files.encode(sealed, kind.what, kind, sort_keys=True)


def parse_sealed(raw: bytes, where: str, kind: _local_files.DocKind) -> dict[str, Any]:
    obj = _local_files.parse(raw, where, kind)
    need(isinstance(obj, dict), where, "the file", "a JSON object", obj)
    body = dict(obj)
    checksum = body.pop("checksum", None)
    need(isinstance(checksum, str), where, "checksum", "a sha256 string", checksum)
    try:
        canonical = encode(body)
    except RecursionError:  # parsed, but nested too deep to encode again
        raise CorruptCheckpointError(f"{where}: nested too deeply to be a valid file") from None
    if sha256(canonical) != checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch: the file was changed or damaged")
    return body


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 60, 60


def show(value: Any) -> str:
    """A short repr of an untrusted value, bounded in time, size and depth."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fail(where: str, field: str, expected: str, found: Any) -> NoReturn:
    raise CorruptCheckpointError(
        f"malformed {where}: field {field}: expected {expected}, found {show(found)}"
    )


def need(cond: bool, where: str, field: str, expected: str, found: Any) -> None:
    if not cond:
        fail(where, field, expected, found)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def int_field(obj: Mapping, key: str, where: str, field: str, *, lo: int = 0, hi: int = 1 << 62):
    value = obj.get(key)
    need(is_int(value) and lo <= value <= hi, where, field, f"an int in [{lo}, {hi}]", value)
    return value


def time_field(obj: Mapping, key: str, where: str, field: str) -> float:
    """An optional time in seconds since the epoch (0.0 when absent), checked."""
    return _local_files.check_time(obj.get(key, 0.0), where, field, stored=True)


def check_format_version(obj: Mapping, where: str, name: str, key: str, known: int) -> int:
    """Checks ``format`` and returns the version under ``key`` (a newer one is refused)."""
    need(obj.get("format") == name, where, "format", repr(name), obj.get("format"))
    version = int_field(obj, key, where, key, lo=1, hi=1 << 30)
    if version > known:
        raise CorruptCheckpointError(
            f"{where} has {key} {version}; this version of flax_orbax_plugin reads up to "
            f"{known}: upgrade flax_orbax_plugin"
        )
    return version


def files_field(obj: Mapping, where: str) -> dict[str, str]:
    files = obj.get("files")
    need(isinstance(files, dict), where, "files", "an object {file: sha256}", files)
    for name, digest in files.items():
        parts = name.split("/")
        safe = all(is_safe_name(p) or p.startswith("_") and is_safe_name(p[1:]) for p in parts)
        need(safe, where, f"files[{name!r}]", "a relative path of safe names", name)
        sha = isinstance(digest, str) and bool(_SHA256.match(digest))
        need(sha, where, f"files[{name!r}]", "a sha256 hex digest", digest)
    return dict(files)


MAX_NDIM = 64
MAX_ARRAY_BYTES = 1 << 50  # 1 PiB: larger "arrays" are damage, not data
MAX_PROCESSES = 1 << 20


PRNG_IMPLS = frozenset({"threefry2x32", "rbg", "unsafe_rbg"})
EMPTY_KINDS = ("empty_dict", "empty_list")  # {} (or a field-less node); [] or ()
# A str or bytes leaf: its value is JSON in the record ("value"; bytes as base64).
TEXT_KINDS = ("py_str", "py_bytes")
MAX_TEXT_BYTES = 64 << 10  # per str (UTF-8) or bytes leaf: larger belongs in an array
NO_DATA_KINDS = ("none", *EMPTY_KINDS, *TEXT_KINDS)  # no shape, dtype, storage or files
LEAF_KINDS = frozenset(
    {"array", "py_int", "py_float", "py_bool", "py_complex", "np_scalar", "prng_key"}
    | set(NO_DATA_KINDS)
)
KEY_KINDS = frozenset({"dict", "seq", "attr", "flat"})
PRNG_KEY_WORDS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}  # uint32 words per key
_REAL = SUPPORTED_DTYPES - {"complex64", "complex128"}
# Python and numpy scalars: shape [] and a dtype their Python type can be made from.
SCALAR_KINDS = {
    "py_int": _REAL,
    "py_float": _REAL,
    "py_bool": _REAL,
    "py_complex": SUPPORTED_DTYPES,
    "np_scalar": SUPPORTED_DTYPES,
}


def batch_name(process: int, dtype: str) -> str:
    """The name of the batch of small leaves of ``dtype`` written by ``process``."""
    return f"{process}.{dtype}"


# A batch's files hold checksummed inner chunks of about 64 KiB, not recorded: every
# reader derives them from the batch's record (:attr:`BatchRecord.inner`): the format's rule.
BATCH_INNER_CHUNK_BYTES = 64 << 10


_CODEC = re.compile(r"^zstd:(?:[1-9]|1[0-9]|2[0-2])$", re.ASCII)


def check_codec(codec: Any, *, where: str = "compression") -> str | None:
    """``None`` or ``"zstd:<level 1-22>"`` (``"zstd"`` means level 3)."""
    if codec is None:
        return None
    if codec == "zstd":
        return "zstd:3"
    if not (isinstance(codec, str) and _CODEC.match(codec)):
        raise ValueError(f"{where}: expected None, 'zstd' or 'zstd:<1-22>', found {codec!r}")
    return codec


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayStorage:
    """A leaf stored as its own zarr3 array ``d/<index>/``, maybe compressed or packed."""

    chunk_shape: tuple[int, ...]
    codec: str | None = None
    packed: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class BatchStorage:
    """A small leaf at ``offset`` (elements) in the batch ``b/<batch>/`` (packed: in bytes)."""

    batch: str
    offset: int
    size: int
    packed: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class LeafRecord:
    """One leaf: its key path, kind, shape, dtype and where its bytes are."""

    path: str
    keys: tuple[tuple[str, Any], ...]
    kind: str
    shape: tuple[int, ...] = ()
    dtype: str | None = None
    sharding: dict[str, Any] | None = None
    storage: ArrayStorage | BatchStorage | None = None
    impl: str | None = None  # PRNG key implementation (kind "prng_key")
    # "xxh3_128r:<hex>" over the leaf's regions and bytes (incremental steps; FORMAT.md)
    digest: str | None = None
    value: str | None = None  # TEXT_KINDS: the str, or the bytes as base64

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self.dtype is None:
            return 0
        return self.size * dtype_from_name(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "keys": [list(k) for k in self.keys]}
        out["kind"] = self.kind
        if self.kind in TEXT_KINDS:
            out["value"] = self.value
        if self.kind in NO_DATA_KINDS:
            return out
        out.update(shape=list(self.shape), dtype=self.dtype, sharding=self.sharding)
        if self.impl is not None:
            out["impl"] = self.impl
        if isinstance(self.storage, ArrayStorage):
            stype = "packed_array" if self.storage.packed else "array"
            out["storage"] = {"type": stype, "chunk_shape": list(self.storage.chunk_shape)}
            if self.storage.codec is not None:
                out["storage"]["codec"] = self.storage.codec
        elif isinstance(self.storage, BatchStorage):
            s = self.storage
            stype = "packed_batch" if s.packed else "batch"
            out["storage"] = {"type": stype, "batch": s.batch, "offset": s.offset, "size": s.size}
        if self.digest is not None:
            out["digest"] = self.digest
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class BatchRecord:
    """1-D zarr3 array ``b/<name>/``: one process's small leaves of a dtype; ``chunk`` per file."""

    name: str
    dtype: str
    process: int
    size: int
    chunk: int
    codec: str | None = None

    @property
    def inner(self) -> int:
        """Elements per checksummed inner chunk of the batch's files (divides ``chunk``)."""
        itemsize = dtype_from_name(self.dtype).itemsize
        chunk = int(self.chunk)
        inner = max(1, min(BATCH_INNER_CHUNK_BYTES // itemsize, chunk))
        while chunk % inner:
            inner -= 1
        return inner

    def to_json(self) -> dict[str, Any]:
        out = {"dtype": self.dtype, "process": self.process, "size": self.size, "chunk": self.chunk}
        if self.codec is not None:
            out["codec"] = self.codec
        return out


FORMAT_NAME = "flax_orbax_plugin"
FORMAT_VERSION = 1
LATEST_FORMAT_VERSION = 2  # _METADATA.json: 1 (a file per chunk) or 2 (data files)
STEP_FORMAT = "flax_orbax_plugin/step"
STEP_VERSION = 1
LANES = ("temporary", "permanent", "forced")  # a step's lane (``lanes.Lanes``, a forced save)

METADATA_FILE = "_METADATA.json"
COMMIT_FILE = "_COMMITTED"
MANIFEST_FILE = "_CHECKPOINT.json"
PENDING_FILE = "_PENDING.json"  # a save in progress (or killed): see _core.ownership
HOST_FILE = "_HOST.json"  # in each host's copy of a step (_manager.per_host); never uploaded
JSON_VALUE_FILE = "value.json"
ARRAYS_DIR = "d"  # d/<i>/: the zarr3 array of leaf number i
BATCHES_DIR = "b"  # b/<name>/: a zarr3 1-D batch of small leaves


def step_dir(step: int) -> str:
    """``<step>``: a manager step's directory, the canonical digits of its number."""
    return str(operator.index(step))


def array_dir(index: int) -> str:
    """``d/<i>``: where leaf number ``index`` is stored as its own array."""
    return f"{ARRAYS_DIR}/{int(index)}"


def batch_dir(name: str) -> str:
    """``b/<name>``: where the batch ``name`` (``records.batch_name``) is stored."""
    return f"{BATCHES_DIR}/{name}"


def iterator_state_file(process_index: int) -> str:
    """``process_<i>.json``: the data iterator state of process ``process_index``."""
    return f"process_{process_index}.json"


@dataclasses.dataclass(frozen=True)
class CheckpointDocument:
    """``_METADATA.json``: every leaf of one pytree and the batches of small leaves."""

    leaves: tuple[LeafRecord, ...]
    batches: dict[str, BatchRecord]
    process_count: int = 1
    created_at: float = 0.0
    jax_version: str = ""
    format_version: int = FORMAT_VERSION
    # Read, not written: the sha256 of the JSON files its commit recorded, by name.
    listed: dict[str, str] | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        _local_files.check_time(self.created_at, METADATA_FILE, "created_at", stored=False)
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "created_at": self.created_at,
            "process_count": self.process_count,
            "jax_version": self.jax_version,
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "batches": {name: b.to_json() for name, b in self.batches.items()},
        }


@dataclasses.dataclass(frozen=True)
class ItemEntry:
    """One checkpointable of a step: its kind and the directory holding it."""

    kind: str
    dir: str


@dataclasses.dataclass(frozen=True)
class StepManifest:
    """``<step>/_CHECKPOINT.json``: the one commit of a manager step. ``files``: the sha256
    of every JSON file restore trusts; ``lane``: the lane the step was saved in."""

    step: int
    items: dict[str, ItemEntry]
    files: dict[str, str]
    process_count: int = 1
    time: float = 0.0
    tree_digest: str = ""
    bytes_written: int | None = None
    bytes_reused: int | None = None
    lane: str | None = None

    def to_bytes(self) -> bytes:
        _local_files.check_time(self.time, MANIFEST_FILE, "time", stored=False)
        body = {
            "format": STEP_FORMAT,
            "version": STEP_VERSION,
            "step": self.step,
            "items": {n: {"kind": e.kind, "dir": e.dir} for n, e in self.items.items()},
            "files": self.files,
            "process_count": self.process_count,
            "time": self.time,
            "tree_digest": self.tree_digest,
        }
        if self.bytes_written is not None and self.bytes_reused is not None:
            body["bytes"] = {"written": self.bytes_written, "reused": self.bytes_reused}
        if self.lane is not None:
            body["lane"] = self.lane
        return seal(body, _local_files.STEP_MANIFEST)


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    """``_COMMITTED`` of a core checkpoint: written last (its presence commits on object stores)."""

    files: dict[str, str]
    committed_at: float = 0.0

    def to_bytes(self) -> bytes:
        _local_files.check_time(self.committed_at, COMMIT_FILE, "committed_at", stored=False)
        return seal(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "committed_at": self.committed_at,
                "files": self.files,
            },
            _local_files.COMMIT_MARKER,
        )

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> CommitMarker:
        obj = _local_files.parse(raw, where, _local_files.COMMIT_MARKER)
        if isinstance(obj, dict) and "checksum" not in obj and "files" not in obj:
            raise CorruptCheckpointError(
                f"{where}: a commit marker without checksums (written before format version "
                f"1 was fixed); re-save it with this version"
            )
        body = parse_sealed(raw, where, _local_files.COMMIT_MARKER)
        check_format_version(body, where, FORMAT_NAME, "format_version", FORMAT_VERSION)
        files = files_field(body, where)
        need(METADATA_FILE in files, where, "files", f"an entry for {METADATA_FILE}", files)
        return cls(files, time_field(body, "committed_at", where, "committed_at"))
