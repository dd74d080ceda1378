"""The on-disk layout, format version 1: typed records for every JSON file.

This module is the only place that knows the JSON field names. Every record has
``to_json()`` and a ``from_json(obj, where)`` that validates every field (types,
ranges, safe names, shapes and offsets bounded and consistent with each other) and
raises :class:`CorruptCheckpointError` naming the file and the field, before anything
sized by the untrusted numbers is allocated. FORMAT.md at the repository root is the
specification; later format versions restore version 1.

Files (see FORMAT.md)::

    <checkpoint>/_METADATA.json   CheckpointDocument: leaves, batches
    <checkpoint>/_COMMITTED       CommitMarker of a standalone core checkpoint
    <step>/_CHECKPOINT.json       StepManifest: the commit of a manager step

Integrity: the marker and the manifest carry the sha256 of every JSON file that
restore trusts (``files``) and a checksum of their own canonical JSON; readers check
both (:func:`decode_checked`, :func:`parse_sealed`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import reprlib
from collections.abc import Mapping
from typing import Any, NoReturn

import ml_dtypes
import numpy as np

from .._base.tree import path_string
from .._errors import CorruptCheckpointError, StructureError

FORMAT_NAME = "flax_orbax_plugin"
FORMAT_VERSION = 1
STEP_FORMAT = "flax_orbax_plugin/step"
STEP_VERSION = 1

METADATA_FILE = "_METADATA.json"
COMMIT_FILE = "_COMMITTED"
MANIFEST_FILE = "_CHECKPOINT.json"
JSON_VALUE_FILE = "value.json"

MAX_JSON_BYTES = 64 << 20  # no metadata, manifest or JSON item is larger than this
MAX_NDIM = 64
MAX_ARRAY_BYTES = 1 << 50  # 1 PiB: larger "arrays" are damage, not data
MAX_PROCESSES = 1 << 20

# dtypes zarr3 (as tensorstore implements it) stores, by numpy name.
SUPPORTED_DTYPES = frozenset(
    "bool int4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 float8_e4m3fn "
    "float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 float8_e5m2fnuz float16 bfloat16 "
    "float32 float64 complex64 complex128".split()
)
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

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", re.ASCII)
_SHA256 = re.compile(r"^[0-9a-f]{64}$", re.ASCII)
# A leaf's optional content digest: "<algorithm>:<hex>" (this version writes xxh3_128r;
# earlier ones wrote xxh3_128, still valid to read).
_LEAF_DIGEST = re.compile(r"^[a-z0-9_]{1,32}:[0-9a-f]{16,128}$", re.ASCII)


# -- dtypes -----------------------------------------------------------------------------


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
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def is_safe_name(name: Any) -> bool:
    """A name usable as one path component: letters, digits, '_', '-', '.'; no '..'."""
    return isinstance(name, str) and bool(_SAFE_NAME.match(name)) and ".." not in name


# -- checksums and JSON -------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(obj: Any) -> bytes:
    """Compact, deterministic JSON bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode(raw: bytes, where: str) -> Any:
    """Parses JSON bytes read from an untrusted store; errors name the file."""
    if len(raw) > MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(raw)} bytes, larger than any valid file")
    try:
        return json.loads(
            raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float
        )
    except _NonFinite as e:
        raise CorruptCheckpointError(
            f"malformed {where}: field {_field_before(raw, e.text)}: expected a finite "
            f"number, found {e.text[:40]}"
        ) from None
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        # RecursionError: nesting deeper than the interpreter's stack (e.g. '[' * 100000)
        raise CorruptCheckpointError(f"{where} is not valid JSON: {_brief(e)}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _NonFinite(ValueError):
    def __init__(self, text: str):
        super().__init__(f"the number {text[:40]} is not finite")
        self.text = text


def _finite_float(text: str) -> float:
    """JSON numbers that overflow to infinity (``1e999``) are refused like ``Infinity``."""
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


_KEY_BEFORE = re.compile(rb'"([^"\\]{1,64})"\s*:\s*[\[\s]*$')


def _field_before(raw: bytes, text: str) -> str:
    """The key under which the number ``text`` first appears in ``raw`` (for the error
    message), else its byte offset."""
    at = raw.find(text.encode())
    if at < 0:
        return "?"
    match = _KEY_BEFORE.search(raw[max(0, at - 200) : at])
    return match.group(1).decode(errors="replace") if match else f"at byte {at}"


def _brief(error: BaseException) -> str:
    text = str(error)
    return text if len(text) <= 200 else text[:197] + "..."


def decode_checked(raw: bytes, where: str, expected_sha256: str) -> Any:
    """Parses ``raw`` after checking it against the checksum recorded at commit."""
    found = sha256(raw)
    if found != expected_sha256:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch: expected sha256 {expected_sha256[:16]}... "
            f"(recorded at commit), found {found[:16]}...; the file was changed or damaged"
        )
    return decode(raw, where)


def seal(body: dict[str, Any]) -> bytes:
    """JSON bytes of ``body`` plus a ``checksum`` of its own canonical form."""
    return encode(dict(body, checksum=sha256(encode(body))))


def parse_sealed(raw: bytes, where: str) -> dict[str, Any]:
    obj = decode(raw, where)
    _need(isinstance(obj, dict), where, "the file", "a JSON object", obj)
    body = dict(obj)
    checksum = body.pop("checksum", None)
    _need(isinstance(checksum, str), where, "checksum", "a sha256 string", checksum)
    try:
        canonical = encode(body)
    except RecursionError:  # parsed, but nested too deep to encode again
        raise CorruptCheckpointError(f"{where}: nested too deeply to be a valid file") from None
    if sha256(canonical) != checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch: the file was changed or damaged")
    return body


# -- validation helpers ------------------------------------------------------------------


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 60, 60


def _show(value: Any) -> str:
    """A short repr of an untrusted value: bounded in time, size and depth (a deeply
    nested or huge value never recurses or builds its whole repr)."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(where: str, field: str, expected: str, found: Any) -> NoReturn:
    raise CorruptCheckpointError(
        f"malformed {where}: field {field}: expected {expected}, found {_show(found)}"
    )


def _need(cond: bool, where: str, field: str, expected: str, found: Any) -> None:
    if not cond:
        _fail(where, field, expected, found)


def _one_of(x: Any, names: frozenset[str]) -> bool:
    return isinstance(x, str) and x in names


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(obj: Mapping, key: str, where: str, field: str, *, lo: int = 0, hi: int = 1 << 62):
    value = obj.get(key)
    _need(_is_int(value) and lo <= value <= hi, where, field, f"an int in [{lo}, {hi}]", value)
    return value


def _num(obj: Mapping, key: str, where: str, field: str) -> float:
    value = obj.get(key, 0.0)
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    _need(ok, where, field, "a finite number", value)
    return float(value)


def _str(obj: Mapping, key: str, where: str, field: str) -> str:
    value = obj.get(key)
    _need(isinstance(value, str), where, field, "a string", value)
    return value


def _opt_str(obj: Mapping, key: str, where: str, *, limit: int = 1000) -> str:
    """An optional, informational string field ("" when absent)."""
    value = obj.get(key, "")
    _need(isinstance(value, str) and len(value) <= limit, where, key, "a short string", value)
    return value


def _format_version(obj: Mapping, where: str, name: str, key: str, known: int) -> int:
    """Checks the ``format`` name and returns the version under ``key``; a version this
    library does not know yet is refused with the way out (upgrade)."""
    _need(obj.get("format") == name, where, "format", repr(name), obj.get("format"))
    version = _int(obj, key, where, key, lo=1, hi=1 << 30)
    if version > known:
        raise CorruptCheckpointError(
            f"{where} has {key} {version}; this version of flax_orbax_plugin reads up to "
            f"{known}: upgrade flax_orbax_plugin"
        )
    return version


def _files(obj: Mapping, where: str) -> dict[str, str]:
    files = obj.get("files")
    _need(isinstance(files, dict), where, "files", "an object {file: sha256}", files)
    for name, digest in files.items():
        parts = name.split("/")
        _need(
            all(is_safe_name(p) or p.startswith("_") and is_safe_name(p[1:]) for p in parts),
            where,
            f"files[{name!r}]",
            "a relative path of safe names",
            name,
        )
        _need(
            isinstance(digest, str) and bool(_SHA256.match(digest)),
            where,
            f"files[{name!r}]",
            "a sha256 hex digest",
            digest,
        )
    return dict(files)


# -- leaves and batches -----------------------------------------------------------------


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
    """A leaf stored as its own zarr3 array ``d/<index>/``; ``codec`` compresses it."""

    chunk_shape: tuple[int, ...]
    codec: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class BatchStorage:
    """A small leaf stored at ``offset`` (elements) in the 1-D batch array ``b/<batch>/``."""

    batch: str
    offset: int
    size: int


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
    # "xxh3_128r:<hex>" over the leaf's regions and their bytes (optional; incremental
    # manager steps; FORMAT.md)
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
        out["shape"] = list(self.shape)
        out["dtype"] = self.dtype
        out["sharding"] = self.sharding
        if self.impl is not None:
            out["impl"] = self.impl
        if isinstance(self.storage, ArrayStorage):
            out["storage"] = {"type": "array", "chunk_shape": list(self.storage.chunk_shape)}
            if self.storage.codec is not None:
                out["storage"]["codec"] = self.storage.codec
        elif isinstance(self.storage, BatchStorage):
            s = self.storage
            out["storage"] = {"type": "batch", "batch": s.batch, "offset": s.offset, "size": s.size}
        if self.digest is not None:
            out["digest"] = self.digest
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str, index: int) -> LeafRecord:
        # Hot path (thousands of leaves): conditions first, messages only on failure.
        if not isinstance(obj, dict):
            _fail(where, f"leaves[{index}]", "an object", obj)
        path = obj.get("path")
        if not isinstance(path, str):
            _fail(where, f"leaves[{index}].path", "a string", path)

        def bad(field: str, expected: str, found: Any) -> NoReturn:
            _fail(where, f"leaves[{index}] ({path!r}).{field}", expected, found)

        kind = obj.get("kind")
        if not _one_of(kind, LEAF_KINDS):
            bad("kind", f"one of {sorted(LEAF_KINDS)}", kind)
        keys = _keys(obj.get("keys"), bad)
        if kind in TEXT_KINDS:
            value = obj.get("value")
            if not (isinstance(value, str) and len(value) <= 2 * MAX_TEXT_BYTES):
                bad("value", f"a string of at most {2 * MAX_TEXT_BYTES} characters", value)
            if kind == "py_bytes":
                text_bytes(value, lambda: bad("value", "base64 text", value))
            elif not _utf8_within(value, MAX_TEXT_BYTES):
                bad("value", f"text of at most {MAX_TEXT_BYTES} bytes in UTF-8", value)
            return cls(path, keys, kind, value=value)
        if kind in NO_DATA_KINDS:
            return cls(path, keys, kind)
        shape = obj.get("shape")
        if not (
            type(shape) is list
            and len(shape) <= MAX_NDIM
            and all(type(d) is int and 0 <= d < (1 << 50) for d in shape)
        ):
            bad("shape", f"a list of at most {MAX_NDIM} non-negative ints", shape)
        shape = tuple(shape)
        dtype = obj.get("dtype")
        if not _one_of(dtype, SUPPORTED_DTYPES):
            bad("dtype", "a supported dtype name", dtype)
        size = math.prod(shape)  # Python ints: never overflows
        if size * dtype_from_name(dtype).itemsize > MAX_ARRAY_BYTES:
            bad("shape", f"at most {MAX_ARRAY_BYTES} bytes", shape)
        if kind in SCALAR_KINDS:
            if shape:
                bad("shape", f"[] (a {kind} is a scalar)", shape)
            if dtype not in SCALAR_KINDS[kind]:
                bad("dtype", f"one of {sorted(SCALAR_KINDS[kind])} (for a {kind})", dtype)
        sharding = obj.get("sharding")
        if not (sharding is None or (isinstance(sharding, dict) and _shallow(sharding))):
            bad("sharding", "an object of at most 4 levels and 1000 values, or null", sharding)
        impl = None
        if kind == "prng_key":
            impl = obj.get("impl")
            if not _one_of(impl, PRNG_IMPLS):
                bad("impl", f"one of {sorted(PRNG_IMPLS)}", impl)
            if dtype != "uint32" or not shape or shape[-1] != PRNG_KEY_WORDS[impl]:
                bad("shape", f"uint32[..., {PRNG_KEY_WORDS[impl]}] (key data of {impl})", shape)
        raw = obj.get("storage")
        if not isinstance(raw, dict):
            bad("storage", "an object", raw)
        storage: ArrayStorage | BatchStorage
        stype = raw.get("type")
        if stype == "batch":
            batch, offset, n = raw.get("batch"), raw.get("offset"), raw.get("size")
            if not isinstance(batch, str):
                bad("storage.batch", "a string", batch)
            if not (type(offset) is int and 0 <= offset <= 1 << 62):
                bad("storage.offset", "an int in [0, 2**62]", offset)
            if n != size or type(n) is not int:
                bad("storage.size", f"{size} (the shape's element count)", n)
            storage = BatchStorage(batch, offset, n)
        elif stype == "array":
            chunk = raw.get("chunk_shape")
            if not (
                type(chunk) is list
                and len(chunk) == len(shape)
                and all(
                    type(c) is int and 1 <= c <= max(1, d)
                    for c, d in zip(chunk, shape, strict=True)
                )
            ):
                bad("storage.chunk_shape", f"{len(shape)} ints in [1, shape]", chunk)
            codec = raw.get("codec")
            if not (codec is None or (isinstance(codec, str) and _CODEC.match(codec))):
                bad("storage.codec", "absent or 'zstd:<1-22>'", codec)
            storage = ArrayStorage(tuple(chunk), codec)
        else:
            bad("storage.type", "'array' or 'batch'", stype)
        digest = obj.get("digest")
        if not (digest is None or (isinstance(digest, str) and _LEAF_DIGEST.match(digest))):
            bad("digest", "absent or '<algorithm>:<hex>' (e.g. 'xxh3_128:' and 32 hex)", digest)
        return cls(path, keys, kind, shape, dtype, sharding, storage, impl, digest)


def _utf8_within(text: str, limit: int) -> bool:
    try:
        return len(text.encode("utf-8")) <= limit
    except UnicodeEncodeError:  # a lone surrogate: no str this library writes
        return False


def text_value(record: LeafRecord) -> str | bytes:
    """The str or bytes a record of a TEXT_KINDS kind holds (checked when parsed)."""
    if record.kind == "py_bytes":
        return text_bytes(record.value or "", lambda: None)
    return record.value or ""


def text_bytes(value: str, on_error) -> bytes:
    """``value`` (base64) decoded; ``on_error()`` is called (and must raise) if it is not
    base64 of at most MAX_TEXT_BYTES bytes."""
    import base64
    import binascii

    try:
        data = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        on_error()
        raise
    if len(data) > MAX_TEXT_BYTES:
        on_error()
    return data


def _shallow(value: Any, *, depth: int = 4, values: int = 1000) -> bool:
    """Whether a JSON value nests at most ``depth`` levels and holds at most ``values``
    values (a sharding description is small; walked without recursion)."""
    stack, seen = [(value, 0)], 0
    while stack:
        x, level = stack.pop()
        seen += 1
        if seen > values or level > depth:
            return False
        if isinstance(x, dict):
            stack.extend((v, level + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, level + 1) for v in x)
    return True


def _keys(keys: Any, bad: Any) -> tuple[tuple[str, Any], ...]:
    """``[[kind, key], ...]`` as a tuple of pairs; ``bad(field, expected, found)`` raises."""
    if not (type(keys) is list and len(keys) <= 1000):
        bad("keys", "a list of [kind, key]", keys)
    out = []
    for k in keys:
        if not (
            type(k) is list
            and len(k) == 2
            and _one_of(k[0], KEY_KINDS)
            and (
                (k[0] in ("seq", "flat") and _is_int(k[1]) and 0 <= k[1] < (1 << 31))
                or (k[0] == "attr" and isinstance(k[1], str))
                or (k[0] == "dict" and (isinstance(k[1], str) or _is_int(k[1])))
            )
        ):
            bad("keys", "[kind, key] pairs", k)
        out.append((k[0], k[1]))
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class BatchRecord:
    """A 1-D zarr3 array ``b/<name>/`` holding small leaves of one dtype, written by one
    process; ``chunk`` elements per stored file."""

    name: str
    dtype: str
    process: int
    size: int
    chunk: int
    codec: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.codec is not None:
            return {**self._fields(), "codec": self.codec}
        return self._fields()

    def _fields(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "process": self.process,
            "size": self.size,
            "chunk": self.chunk,
        }

    @classmethod
    def from_json(cls, name: str, obj: Any, where: str, process_count: int) -> BatchRecord:
        at = f"batches[{name!r}]"
        _need(isinstance(obj, dict), where, at, "an object", obj)
        dtype = obj.get("dtype")
        _need(
            _one_of(dtype, SUPPORTED_DTYPES), where, f"{at}.dtype", "a supported dtype name", dtype
        )
        process = _int(obj, "process", where, f"{at}.process", hi=process_count - 1)
        itemsize = dtype_from_name(dtype).itemsize
        size = _int(obj, "size", where, f"{at}.size", lo=1, hi=MAX_ARRAY_BYTES // itemsize)
        chunk = _int(obj, "chunk", where, f"{at}.chunk", lo=1, hi=MAX_ARRAY_BYTES // itemsize)
        _need(
            name == batch_name(process, dtype),
            where,
            at,
            f"name {batch_name(process, dtype)!r}",
            name,
        )
        codec = obj.get("codec")
        _need(
            codec is None or (isinstance(codec, str) and bool(_CODEC.match(codec))),
            where,
            f"{at}.codec",
            "absent or 'zstd:<1-22>'",
            codec,
        )
        return cls(name, dtype, process, size, chunk, codec)


def batch_name(process: int, dtype: str) -> str:
    return f"{process}.{dtype}"


# -- a checkpoint's metadata ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointDocument:
    """``_METADATA.json``: every leaf of one pytree and the batches of small leaves."""

    leaves: tuple[LeafRecord, ...]
    batches: dict[str, BatchRecord]
    process_count: int = 1
    created_at: float = 0.0
    jax_version: str = ""
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "created_at": self.created_at,
            "process_count": self.process_count,
            "jax_version": self.jax_version,
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "batches": {name: b.to_json() for name, b in self.batches.items()},
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> CheckpointDocument:
        _need(isinstance(obj, dict), where, "the file", "a JSON object", obj)
        version = _format_version(obj, where, FORMAT_NAME, "format_version", FORMAT_VERSION)
        process_count = _int(obj, "process_count", where, "process_count", lo=1, hi=MAX_PROCESSES)
        raw_leaves = obj.get("leaves")
        _need(isinstance(raw_leaves, list), where, "leaves", "a list", raw_leaves)
        raw_batches = obj.get("batches")
        _need(isinstance(raw_batches, dict), where, "batches", "an object", raw_batches)
        batches = {
            name: BatchRecord.from_json(name, b, where, process_count)
            for name, b in raw_batches.items()
        }
        leaves = tuple(LeafRecord.from_json(r, where, i) for i, r in enumerate(raw_leaves))
        _check_leaves(leaves, batches, where)
        return cls(
            leaves,
            batches,
            process_count,
            _num(obj, "created_at", where, "created_at"),
            _opt_str(obj, "jax_version", where),
            version,
        )


def _check_leaves(leaves: tuple[LeafRecord, ...], batches: dict[str, BatchRecord], where: str):
    seen: set[str] = set()
    limit = 2 * len(leaves)
    tree = _TreeShape()
    for i, leaf in enumerate(leaves):

        def bad(field: str, expected: str, found: Any, leaf=leaf, i=i) -> NoReturn:
            _fail(where, f"leaves[{i}] ({leaf.path!r}).{field}", expected, found)

        if leaf.path in seen:
            bad("path", "a path no other leaf has", leaf.path)
        seen.add(leaf.path)
        expected_path = path_string(leaf.keys)
        if leaf.path != expected_path:
            bad("path", f"{expected_path!r} (from its keys)", leaf.path)
        if not leaf.keys and len(leaves) != 1:
            bad("keys", "a key path (only a lone leaf may be the root)", [])
        for kind, key in leaf.keys:
            if kind in ("seq", "flat") and key > limit:
                bad("keys", "indices below the leaf count", key)
        conflict = tree.add(leaf.keys)
        if conflict:
            bad("keys", *conflict)
        storage = leaf.storage
        if isinstance(storage, BatchStorage):
            batch = batches.get(storage.batch)
            if batch is None:
                bad("storage.batch", f"one of {sorted(batches)}", storage.batch)
            if batch.dtype != leaf.dtype:
                bad("storage.batch", f"a batch of dtype {leaf.dtype}", batch.dtype)
            if storage.offset + storage.size > batch.size:
                bad("storage.offset", f"offset + size <= {batch.size}", storage.offset)


class _TreeShape:
    """The nodes that the leaves' key paths make, checked to form one pytree as restore
    rebuilds it: a node's children are all list entries (``seq``/``flat``) or all
    mapping entries (``dict``/``attr``), the keys of one mapping are all ``str`` or all
    ``int`` (jax cannot order mixed keys), and no leaf is also a node. Memory: one
    entry per distinct key path prefix (bounded by the metadata's size)."""

    def __init__(self):
        self._child: dict[tuple[int, str, Any], int] = {}
        self._form: list[Any] = [None]  # per node: None (unseen), "leaf", or (kind, key type)

    def add(self, keys: tuple[tuple[str, Any], ...]) -> tuple[str, Any] | None:
        """Adds one leaf; (expected, found) describing the first conflict, else None."""
        node = 0
        for kind, key in keys:
            form = ("list", int) if kind in ("seq", "flat") else ("map", type(key))
            known = self._form[node]
            if known == "leaf":
                return "a key path under no other leaf", [kind, key]
            if known is None:
                self._form[node] = form
            elif known != form:
                expected = "list entries" if known[0] == "list" else f"{known[1].__name__} keys"
                return f"{expected} like its siblings'", [kind, key]
            slot = (node, form[0], key)
            child = self._child.get(slot)
            if child is None:
                child = self._child[slot] = len(self._form)
                self._form.append(None)
            node = child
        if self._form[node] is not None:
            return "a leaf with no other leaf under it", list(keys[-1]) if keys else []
        self._form[node] = "leaf"
        return None


# -- commit records -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    """``_COMMITTED`` of a standalone core checkpoint: written last; its presence is the
    commit on object stores. Carries the sha256 of ``_METADATA.json``."""

    files: dict[str, str]
    committed_at: float = 0.0

    def to_bytes(self) -> bytes:
        return seal(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "committed_at": self.committed_at,
                "files": self.files,
            }
        )

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> CommitMarker:
        obj = decode(raw, where)
        if isinstance(obj, dict) and "checksum" not in obj and "files" not in obj:
            raise CorruptCheckpointError(
                f"{where}: a commit marker without checksums (written before format version "
                f"1 was fixed); re-save it with this version"
            )
        body = parse_sealed(raw, where)
        _format_version(body, where, FORMAT_NAME, "format_version", FORMAT_VERSION)
        files = _files(body, where)
        _need(METADATA_FILE in files, where, "files", f"an entry for {METADATA_FILE}", files)
        return cls(files, _num(body, "committed_at", where, "committed_at"))


@dataclasses.dataclass(frozen=True)
class ItemEntry:
    """One checkpointable of a step: its kind and the directory holding it."""

    kind: str
    dir: str


@dataclasses.dataclass(frozen=True)
class StepManifest:
    """``<step>/_CHECKPOINT.json``: the one commit of a manager step.

    ``files`` maps every JSON file of the step that restore trusts (relative to the
    step) to its sha256; ``tree_digest`` is the digest all processes agreed on.
    ``bytes_written``/``bytes_reused`` (optional, one-process steps only): array bytes
    the save wrote, and those of unchanged leaves it took from the previous step
    (hard links or server-side copies) instead; informational.
    """

    step: int
    items: dict[str, ItemEntry]
    files: dict[str, str]
    process_count: int = 1
    time: float = 0.0
    tree_digest: str = ""
    bytes_written: int | None = None
    bytes_reused: int | None = None

    def to_bytes(self) -> bytes:
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
        return seal(body)

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> StepManifest:
        body = parse_sealed(raw, where)
        _format_version(body, where, STEP_FORMAT, "version", STEP_VERSION)
        step = _int(body, "step", where, "step")
        raw_items = body.get("items")
        _need(isinstance(raw_items, dict), where, "items", "an object", raw_items)
        items = {}
        for name, entry in raw_items.items():
            _need(is_safe_name(name), where, f"items[{name!r}]", "a safe item name", name)
            _need(isinstance(entry, dict), where, f"items[{name!r}]", "an object", entry)
            kind = _str(entry, "kind", where, f"items[{name!r}].kind")
            d = entry.get("dir")
            _need(is_safe_name(d), where, f"items[{name!r}].dir", "a safe directory name", d)
            items[name] = ItemEntry(kind, d)
        dirs = [e.dir for e in items.values()]
        _need(len(set(dirs)) == len(dirs), where, "items", "distinct directories", dirs)
        written = reused = None
        if "bytes" in body:
            sizes = body["bytes"]
            _need(isinstance(sizes, dict), where, "bytes", "an object", sizes)
            written = _int(sizes, "written", where, "bytes.written")
            reused = _int(sizes, "reused", where, "bytes.reused")
        return cls(
            step,
            items,
            _files(body, where),
            _int(body, "process_count", where, "process_count", lo=1, hi=MAX_PROCESSES),
            _num(body, "time", where, "time"),
            _opt_str(body, "tree_digest", where),
            written,
            reused,
        )

    def file_checksum(self, item_dir: str, name: str) -> str | None:
        return self.files.get(f"{item_dir}/{name}")
