"""Checked JSON (checksums, bounded parsing, validators), bounds, and the records of one
leaf and one batch. The dtypes they name: ``dtypes``.

Pure functions over immutable records; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.layout.records``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import math
import re
import reprlib
from collections.abc import Mapping
from typing import Any, NoReturn

from ..._errors import CorruptCheckpointError
from ..._storage import local_files as _local_files
from .dtypes import DTYPES, SUPPORTED_DTYPES, dtype_from_name, packable, packed_bytes

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", re.ASCII)
_SHA256 = re.compile(r"^[0-9a-f]{64}$", re.ASCII)


def is_safe_name(name: Any) -> bool:
    """A name usable as one path component: letters, digits, '_', '-', '.'; no '..'."""
    return isinstance(name, str) and bool(_SAFE_NAME.match(name)) and ".." not in name


# -- checksums and JSON -------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(obj: Any) -> bytes:
    """Compact, deterministic JSON bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode(raw: bytes, where: str, kind: _local_files.DocKind) -> Any:
    """Parses JSON bytes read from an untrusted store as a document of ``kind`` (its
    size, depth and key limits: ``_storage/local_files.py``); errors name the file."""
    return _local_files.parse(raw, where, kind)


def decode_checked(raw: bytes, where: str, expected_sha256: str, kind: _local_files.DocKind) -> Any:
    """Parses ``raw`` after checking it against the checksum recorded at commit."""
    found = sha256(raw)
    if found != expected_sha256:
        sha256_mismatch(where, expected_sha256, found)
    return decode(raw, where, kind)


def sha256_mismatch(where: str, expected: str, found: str) -> NoReturn:
    """Raises the CorruptCheckpointError of a JSON file whose sha256 differs from the
    one recorded at commit."""
    raise CorruptCheckpointError(
        f"{where}: checksum mismatch: expected sha256 {expected[:16]}... "
        f"(recorded at commit), found {found[:16]}...; the file was changed or damaged"
    )


def seal(body: dict[str, Any], kind: _local_files.DocKind | None = None) -> bytes:
    """JSON bytes of ``body`` plus a ``checksum`` of its own canonical form; with
    ``kind``, refused (StructureError) past what a reader of that kind accepts."""
    sealed = dict(body, checksum=sha256(encode(body)))
    if kind is None:
        return encode(sealed)
    return _local_files.encode(sealed, kind.what, kind, sort_keys=True)


def parse_sealed(raw: bytes, where: str, kind: _local_files.DocKind) -> dict[str, Any]:
    obj = decode(raw, where, kind)
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


# -- validation helpers ------------------------------------------------------------------


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 60, 60


def show(value: Any) -> str:
    """A short repr of an untrusted value: bounded in time, size and depth (a deeply
    nested or huge value never recurses or builds its whole repr)."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fail(where: str, field: str, expected: str, found: Any) -> NoReturn:
    raise CorruptCheckpointError(
        f"malformed {where}: field {field}: expected {expected}, found {show(found)}"
    )


def need(cond: bool, where: str, field: str, expected: str, found: Any) -> None:
    if not cond:
        fail(where, field, expected, found)


def one_of(x: Any, names: frozenset[str]) -> bool:
    return isinstance(x, str) and x in names


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def int_field(obj: Mapping, key: str, where: str, field: str, *, lo: int = 0, hi: int = 1 << 62):
    value = obj.get(key)
    need(is_int(value) and lo <= value <= hi, where, field, f"an int in [{lo}, {hi}]", value)
    return value


def time_field(obj: Mapping, key: str, where: str, field: str) -> float:
    """An optional time in seconds since the epoch (0.0 when absent), within what the
    platform formats as a date (``json_docs.check_time``)."""
    return _local_files.check_time(obj.get(key, 0.0), where, field, stored=True)


def str_field(obj: Mapping, key: str, where: str, field: str) -> str:
    value = obj.get(key)
    need(isinstance(value, str), where, field, "a string", value)
    return value


def opt_str(obj: Mapping, key: str, where: str, *, limit: int = 1000) -> str:
    """An optional, informational string field ("" when absent)."""
    value = obj.get(key, "")
    need(isinstance(value, str) and len(value) <= limit, where, key, "a short string", value)
    return value


def check_format_version(obj: Mapping, where: str, name: str, key: str, known: int) -> int:
    """Checks the ``format`` name and returns the version under ``key``; a version this
    library does not know yet is refused with the way out (upgrade)."""
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
        need(
            all(is_safe_name(p) or p.startswith("_") and is_safe_name(p[1:]) for p in parts),
            where,
            f"files[{name!r}]",
            "a relative path of safe names",
            name,
        )
        need(
            isinstance(digest, str) and bool(_SHA256.match(digest)),
            where,
            f"files[{name!r}]",
            "a sha256 hex digest",
            digest,
        )
    return dict(files)


MAX_JSON_BYTES = _local_files.METADATA.max_bytes  # every kind's limits: _storage/local_files.py
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


# A batch's files hold checksummed inner chunks of about 64 KiB. The inner chunk is not
# recorded (version 2 has no zarr.json): every reader derives it from the batch's record
# (:attr:`BatchRecord.inner`), so this rule is the format's.
BATCH_INNER_CHUNK_BYTES = 64 << 10

# A leaf's optional content digest: "<algorithm>:<hex>" (this version writes xxh3_128r;
# earlier ones wrote xxh3_128, still valid to read).
_LEAF_DIGEST = re.compile(r"^[a-z0-9_]{1,32}:[0-9a-f]{16,128}$", re.ASCII)
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
    """A leaf stored as its own zarr3 array ``d/<index>/``; ``codec`` compresses it;
    ``packed``: a sub-byte dtype's values packed into bits (``_zarr/chunks.py``)."""

    chunk_shape: tuple[int, ...]
    codec: str | None = None
    packed: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class BatchStorage:
    """A small leaf stored at ``offset`` (elements) in the 1-D batch array ``b/<batch>/``;
    ``packed``: a sub-byte leaf's values packed into ``size`` bytes of a ``uint8`` batch."""

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

    @classmethod
    def from_json(cls, obj: Any, where: str, index: int) -> LeafRecord:
        # Hot path (thousands of leaves): conditions first, messages only on failure.
        if not isinstance(obj, dict):
            fail(where, f"leaves[{index}]", "an object", obj)
        path = obj.get("path")
        if not isinstance(path, str):
            fail(where, f"leaves[{index}].path", "a string", path)

        def bad(field: str, expected: str, found: Any) -> NoReturn:
            fail(where, f"leaves[{index}] ({path!r}).{field}", expected, found)

        kind = obj.get("kind")
        if not one_of(kind, LEAF_KINDS):
            bad("kind", f"one of {sorted(LEAF_KINDS)}", kind)
        keys = _keys(obj.get("keys"), bad)
        if kind in TEXT_KINDS:
            return cls(path, keys, kind, value=_text_field(obj, kind, bad))
        if kind in NO_DATA_KINDS:
            return cls(path, keys, kind)
        shape, dtype, size = _shape_and_dtype(obj, kind, bad)
        sharding = obj.get("sharding")
        if not (sharding is None or (isinstance(sharding, dict) and _shallow(sharding))):
            bad("sharding", "an object of at most 4 levels and 1000 values, or null", sharding)
        impl = _prng_impl(obj, dtype, shape, bad) if kind == "prng_key" else None
        storage = _storage_field(obj.get("storage"), shape, size, bad, dtype)
        if isinstance(storage, ArrayStorage) and storage.packed:
            _check_packed(dtype, shape, storage.chunk_shape, bad)
        digest = obj.get("digest")
        if not (digest is None or (isinstance(digest, str) and _LEAF_DIGEST.match(digest))):
            bad("digest", "absent or '<algorithm>:<hex>' (e.g. 'xxh3_128:' and 32 hex)", digest)
        return cls(path, keys, kind, shape, dtype, sharding, storage, impl, digest)


# The parts of LeafRecord.from_json; ``bad(field, expected, found)`` raises.


def _text_field(obj: dict, kind: str, bad) -> str:
    """The ``value`` of a str or bytes leaf: bounded text (bytes: base64)."""
    value = obj.get("value")
    if not (isinstance(value, str) and len(value) <= 2 * MAX_TEXT_BYTES):
        bad("value", f"a string of at most {2 * MAX_TEXT_BYTES} characters", value)
    if kind == "py_bytes":
        text_bytes(value, lambda: bad("value", "base64 text", value))
    elif not _utf8_within(value, MAX_TEXT_BYTES):
        bad("value", f"text of at most {MAX_TEXT_BYTES} bytes in UTF-8", value)
    return value


def _shape_and_dtype(obj: dict, kind: str, bad) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype name, element count): bounded, and a scalar's for a scalar kind."""
    shape = obj.get("shape")
    if not (
        type(shape) is list
        and len(shape) <= MAX_NDIM
        and all(type(d) is int and 0 <= d < (1 << 50) for d in shape)
    ):
        bad("shape", f"a list of at most {MAX_NDIM} non-negative ints", shape)
    shape = tuple(shape)
    dtype = obj.get("dtype")
    if not one_of(dtype, SUPPORTED_DTYPES):
        bad("dtype", "a supported dtype name", dtype)
    size = math.prod(shape)  # Python ints: never overflows
    if size * dtype_from_name(dtype).itemsize > MAX_ARRAY_BYTES:
        bad("shape", f"at most {MAX_ARRAY_BYTES} bytes", shape)
    if kind in SCALAR_KINDS:
        if shape:
            bad("shape", f"[] (a {kind} is a scalar)", shape)
        if dtype not in SCALAR_KINDS[kind]:
            bad("dtype", f"one of {sorted(SCALAR_KINDS[kind])} (for a {kind})", dtype)
    return shape, dtype, size


def _prng_impl(obj: dict, dtype: str, shape: tuple[int, ...], bad) -> str:
    """A PRNG key leaf's ``impl``, and its key data's shape for that implementation."""
    impl = obj.get("impl")
    if not one_of(impl, PRNG_IMPLS):
        bad("impl", f"one of {sorted(PRNG_IMPLS)}", impl)
    if dtype != "uint32" or not shape or shape[-1] != PRNG_KEY_WORDS[impl]:
        bad("shape", f"uint32[..., {PRNG_KEY_WORDS[impl]}] (key data of {impl})", shape)
    return impl


def _check_packed(dtype: str, shape: tuple[int, ...], chunk: tuple[int, ...], bad) -> None:
    """A ``packed_array`` holds a sub-byte dtype, at least one axis, and chunks whose
    last axis is whole bytes or the whole axis (FORMAT.md, packed sub-byte arrays)."""
    if not packable(dtype, shape, chunk):
        bad(
            "storage.type",
            f"'array' ({dtype}{list(shape)} in chunks {list(chunk)})",
            "packed_array",
        )


def _storage_field(
    raw: Any, shape: tuple[int, ...], size: int, bad, dtype: str
) -> ArrayStorage | BatchStorage:
    """A data leaf's ``storage``: a slot in a batch, or an array of its own."""
    if not isinstance(raw, dict):
        bad("storage", "an object", raw)
    stype = raw.get("type")
    if stype in ("batch", "packed_batch"):
        packed = stype == "packed_batch"
        batch, offset, n = raw.get("batch"), raw.get("offset"), raw.get("size")
        if not isinstance(batch, str):
            bad("storage.batch", "a string", batch)
        if not (type(offset) is int and 0 <= offset <= 1 << 62):
            bad("storage.offset", "an int in [0, 2**62]", offset)
        if packed and DTYPES[dtype].bits >= 8:
            bad("storage.type", f"'batch' (a {dtype} is not packed)", stype)
        want = packed_bytes(dtype, size) if packed else size
        if n != want or type(n) is not int:
            shown = "bytes of its packed values" if packed else "the shape's element count"
            bad("storage.size", f"{want} ({shown})", n)
        return BatchStorage(batch, offset, n, packed)
    if stype in ("array", "packed_array"):
        chunk = raw.get("chunk_shape")
        if not (
            type(chunk) is list
            and len(chunk) == len(shape)
            and all(
                type(c) is int and 1 <= c <= max(1, d) for c, d in zip(chunk, shape, strict=True)
            )
        ):
            bad("storage.chunk_shape", f"{len(shape)} ints in [1, shape]", chunk)
        codec = raw.get("codec")
        if not (codec is None or (isinstance(codec, str) and _CODEC.match(codec))):
            bad("storage.codec", "absent or 'zstd:<1-22>'", codec)
        return ArrayStorage(tuple(chunk), codec, stype == "packed_array")
    bad("storage.type", "'array', 'packed_array', 'batch' or 'packed_batch'", stype)


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
            and one_of(k[0], KEY_KINDS)
            and (
                (k[0] in ("seq", "flat") and is_int(k[1]) and 0 <= k[1] < (1 << 31))
                or (k[0] == "attr" and isinstance(k[1], str))
                or (k[0] == "dict" and (isinstance(k[1], str) or is_int(k[1])))
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
        need(isinstance(obj, dict), where, at, "an object", obj)
        dtype = obj.get("dtype")
        need(one_of(dtype, SUPPORTED_DTYPES), where, f"{at}.dtype", "a supported dtype name", dtype)
        process = int_field(obj, "process", where, f"{at}.process", hi=process_count - 1)
        itemsize = dtype_from_name(dtype).itemsize
        size = int_field(obj, "size", where, f"{at}.size", lo=1, hi=MAX_ARRAY_BYTES // itemsize)
        chunk = int_field(obj, "chunk", where, f"{at}.chunk", lo=1, hi=MAX_ARRAY_BYTES // itemsize)
        need(
            name == batch_name(process, dtype),
            where,
            at,
            f"name {batch_name(process, dtype)!r}",
            name,
        )
        codec = obj.get("codec")
        need(
            codec is None or (isinstance(codec, str) and bool(_CODEC.match(codec))),
            where,
            f"{at}.codec",
            "absent or 'zstd:<1-22>'",
            codec,
        )
        return cls(name, dtype, process, size, chunk, codec)
