"""The on-disk layout, format version 1 (FORMAT.md is the specification), read back: each
record from storage, every field checked before anything sized by it is allocated, and
the JSON files of a committed step read against the checksums its commit recorded (never
following a link); ``records`` makes them (re-exported here, ``X as X``). Also the
result types of :func:`flax_orbax_plugin.metadata`. Any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.layout``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, NoReturn

from .._base.key_paths import path_string
from .._errors import CheckpointNotFoundError, CorruptCheckpointError, ForeignEntryError
from .._storage import local_files as _local_files
from .._storage.location import Location
from .records import (
    _CODEC,
    FORMAT_NAME,
    KEY_KINDS,
    LANES,
    LATEST_FORMAT_VERSION,
    LEAF_KINDS,
    MAX_ARRAY_BYTES,
    MAX_NDIM,
    MAX_PROCESSES,
    PRNG_IMPLS,
    PRNG_KEY_WORDS,
    SCALAR_KINDS,
    STEP_FORMAT,
    check_format_version,
    fail,
    files_field,
    int_field,
    is_int,
    need,
    parse_sealed,
    time_field,
)
from .records import ARRAYS_DIR as ARRAYS_DIR
from .records import BATCHES_DIR as BATCHES_DIR
from .records import COMMIT_FILE as COMMIT_FILE
from .records import DTYPES as DTYPES
from .records import EMPTY_KINDS as EMPTY_KINDS
from .records import HOST_FILE as HOST_FILE
from .records import JSON_VALUE_FILE as JSON_VALUE_FILE
from .records import MANIFEST_FILE as MANIFEST_FILE
from .records import MAX_TEXT_BYTES as MAX_TEXT_BYTES
from .records import METADATA_FILE as METADATA_FILE
from .records import NO_DATA_KINDS as NO_DATA_KINDS
from .records import PENDING_FILE as PENDING_FILE
from .records import STEP_VERSION as STEP_VERSION
from .records import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from .records import TEXT_KINDS as TEXT_KINDS
from .records import ArrayStorage as ArrayStorage
from .records import BatchRecord as BatchRecord
from .records import BatchStorage as BatchStorage
from .records import CheckpointDocument as CheckpointDocument
from .records import CommitMarker as CommitMarker
from .records import ItemEntry as ItemEntry
from .records import LeafRecord as LeafRecord
from .records import StepManifest as StepManifest
from .records import array_dir as array_dir
from .records import batch_dir as batch_dir
from .records import batch_name as batch_name
from .records import check_codec as check_codec
from .records import dtype_from_name as dtype_from_name
from .records import dtype_name as dtype_name
from .records import encode as encode
from .records import is_safe_name as is_safe_name
from .records import iterator_state_file as iterator_state_file
from .records import packable as packable
from .records import packed_bytes as packed_bytes
from .records import seal as seal
from .records import sha256 as sha256
from .records import step_dir as step_dir

# Canonical step names only: ``0`` or digits without a leading zero (``007`` is foreign).
STEP_NAME = r"(0|[1-9][0-9]{0,17})"
STEP_RE = re.compile(rf"^{STEP_NAME}$", re.ASCII)


def _checked(raw: bytes, where: str, expected: str) -> bytes:
    """``raw``, whose sha256 must be ``expected`` (recorded at commit)."""
    found = sha256(raw)
    if found != expected:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch: expected sha256 {expected[:16]}... "
            f"(recorded at commit), found {found[:16]}...; the file was changed or damaged"
        )
    return raw


def one_of(x: Any, names: frozenset[str]) -> bool:
    return isinstance(x, str) and x in names


def opt_str(obj: Mapping, key: str, where: str, *, limit: int = 1000) -> str:
    """An optional, informational string field ("" when absent)."""
    value = obj.get(key, "")
    need(isinstance(value, str) and len(value) <= limit, where, key, "a short string", value)
    return value


# A leaf's optional content digest: "<algorithm>:<hex>" (this version writes xxh3_128r;
# earlier ones wrote xxh3_128, still valid to read).
_LEAF_DIGEST = re.compile(r"^[a-z0-9_]{1,32}:[0-9a-f]{16,128}$", re.ASCII)


def document_from_json(obj: Any, where: str) -> CheckpointDocument:
    need(isinstance(obj, dict), where, "the file", "a JSON object", obj)
    version = check_format_version(obj, where, FORMAT_NAME, "format_version", LATEST_FORMAT_VERSION)
    process_count = int_field(obj, "process_count", where, "process_count", lo=1, hi=MAX_PROCESSES)
    raw_leaves = obj.get("leaves")
    need(isinstance(raw_leaves, list), where, "leaves", "a list", raw_leaves)
    raw_batches = obj.get("batches")
    need(isinstance(raw_batches, dict), where, "batches", "an object", raw_batches)
    batches = {
        name: batch_from_json(name, b, where, process_count) for name, b in raw_batches.items()
    }
    leaves = tuple(leaf_from_json(r, where, i) for i, r in enumerate(raw_leaves))
    _check_leaves(leaves, batches, where)
    created_at = time_field(obj, "created_at", where, "created_at")
    jax_version = opt_str(obj, "jax_version", where)
    return CheckpointDocument(leaves, batches, process_count, created_at, jax_version, version)


def _check_leaves(leaves: tuple[LeafRecord, ...], batches: dict[str, BatchRecord], where: str):
    seen: set[str] = set()
    limit = 2 * len(leaves)
    tree = _TreeShape()
    for i, leaf in enumerate(leaves):

        def bad(field: str, expected: str, found: Any, leaf=leaf, i=i) -> NoReturn:
            fail(where, f"leaves[{i}] ({leaf.path!r}).{field}", expected, found)

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
            held = "uint8" if storage.packed else leaf.dtype  # packed: bytes of a uint8 batch
            if batch.dtype != held:
                bad("storage.batch", f"a batch of dtype {held}", batch.dtype)
            if storage.offset + storage.size > batch.size:
                bad("storage.offset", f"offset + size <= {batch.size}", storage.offset)


class _TreeShape:
    """The nodes the leaves' key paths make, checked to form one pytree (jax cannot order
    a mapping's mixed ``str`` and ``int`` keys; no leaf is also a node)."""

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


def batch_from_json(name: str, obj: Any, where: str, process_count: int) -> BatchRecord:
    at = f"batches[{name!r}]"
    need(isinstance(obj, dict), where, at, "an object", obj)
    dtype = obj.get("dtype")
    need(one_of(dtype, SUPPORTED_DTYPES), where, f"{at}.dtype", "a supported dtype name", dtype)
    process = int_field(obj, "process", where, f"{at}.process", hi=process_count - 1)
    itemsize = dtype_from_name(dtype).itemsize
    size = int_field(obj, "size", where, f"{at}.size", lo=1, hi=MAX_ARRAY_BYTES // itemsize)
    chunk = int_field(obj, "chunk", where, f"{at}.chunk", lo=1, hi=MAX_ARRAY_BYTES // itemsize)
    expected = batch_name(process, dtype)
    need(name == expected, where, at, f"name {expected!r}", name)
    codec = obj.get("codec")
    need(_codec_ok(codec), where, f"{at}.codec", "absent or 'zstd:<1-22>'", codec)
    return BatchRecord(name, dtype, process, size, chunk, codec)


def leaf_from_json(obj: Any, where: str, index: int) -> LeafRecord:
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
        return LeafRecord(path, keys, kind, value=_text_field(obj, kind, bad))
    if kind in NO_DATA_KINDS:
        return LeafRecord(path, keys, kind)
    shape, dtype, size = _shape_and_dtype(obj, kind, bad)
    sharding = obj.get("sharding")
    if not (sharding is None or (isinstance(sharding, dict) and _shallow(sharding))):
        bad("sharding", "an object of at most 4 levels and 1000 values, or null", sharding)
    impl = _prng_impl(obj, dtype, shape, bad) if kind == "prng_key" else None
    storage = _storage_field(obj.get("storage"), shape, size, bad, dtype)
    digest = obj.get("digest")
    if not (digest is None or (isinstance(digest, str) and _LEAF_DIGEST.match(digest))):
        bad("digest", "absent or '<algorithm>:<hex>' (e.g. 'xxh3_128:' and 32 hex)", digest)
    return LeafRecord(path, keys, kind, shape, dtype, sharding, storage, impl, digest)


def _text_field(obj: dict, kind: str, bad) -> str:
    """The ``value`` of a str or bytes leaf: bounded text (bytes: base64)."""
    value = obj.get("value")
    if not (isinstance(value, str) and len(value) <= 2 * MAX_TEXT_BYTES):
        bad("value", f"a string of at most {2 * MAX_TEXT_BYTES} characters", value)
    if kind == "py_bytes":
        text_bytes(value, lambda: bad("value", "base64 text", value))
    else:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: no str this library writes
            size = MAX_TEXT_BYTES + 1
        if size > MAX_TEXT_BYTES:
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
        if not _codec_ok(codec):
            bad("storage.codec", "absent or 'zstd:<1-22>'", codec)
        if stype == "packed_array" and not packable(dtype, shape, chunk):  # FORMAT.md
            bad("storage.type", f"'array' ({dtype}{list(shape)} in chunks {chunk})", stype)
        return ArrayStorage(tuple(chunk), codec, stype == "packed_array")
    bad("storage.type", "'array', 'packed_array', 'batch' or 'packed_batch'", stype)


def _codec_ok(codec: Any) -> bool:
    """Whether a stored ``codec`` field is absent or ``"zstd:<1-22>"``."""
    return codec is None or (isinstance(codec, str) and bool(_CODEC.match(codec)))


def text_value(record: LeafRecord) -> str | bytes:
    """The str or bytes a record of a TEXT_KINDS kind holds (checked when parsed)."""
    if record.kind == "py_bytes":
        return text_bytes(record.value or "", lambda: None)
    return record.value or ""


def text_bytes(value: str, on_error) -> bytes:
    """``value`` (base64) decoded; else ``on_error()``, which must raise."""
    try:
        data = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        on_error()
        raise
    if len(data) > MAX_TEXT_BYTES:
        on_error()
    return data


def _shallow(value: Any, *, depth: int = 4, values: int = 1000) -> bool:
    """Whether a JSON value nests at most ``depth`` levels and ``values`` values (no recursion)."""
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


def manifest_from_bytes(raw: bytes, where: str) -> StepManifest:
    """The step manifest ``raw`` (``<step>/_CHECKPOINT.json``), every field checked."""
    body = parse_sealed(raw, where, _local_files.STEP_MANIFEST)
    check_format_version(body, where, STEP_FORMAT, "version", STEP_VERSION)
    step = int_field(body, "step", where, "step")
    raw_items = body.get("items")
    need(isinstance(raw_items, dict), where, "items", "an object", raw_items)
    items = {}
    for name, entry in raw_items.items():
        need(is_safe_name(name), where, f"items[{name!r}]", "a safe item name", name)
        need(isinstance(entry, dict), where, f"items[{name!r}]", "an object", entry)
        kind = entry.get("kind")
        need(isinstance(kind, str), where, f"items[{name!r}].kind", "a string", kind)
        d = entry.get("dir")
        need(is_safe_name(d), where, f"items[{name!r}].dir", "a safe directory name", d)
        items[name] = ItemEntry(kind, d)
    dirs = [e.dir for e in items.values()]
    need(len(set(dirs)) == len(dirs), where, "items", "distinct directories", dirs)
    written = reused = None
    if "bytes" in body:
        sizes = body["bytes"]
        need(isinstance(sizes, dict), where, "bytes", "an object", sizes)
        written = int_field(sizes, "written", where, "bytes.written")
        reused = int_field(sizes, "reused", where, "bytes.reused")
    lane = body.get("lane")
    need(lane is None or lane in LANES, where, "lane", f"one of {LANES}", lane)
    files = files_field(body, where)
    processes = int_field(body, "process_count", where, "process_count", lo=1, hi=MAX_PROCESSES)
    time, digest = time_field(body, "time", where, "time"), opt_str(body, "tree_digest", where)
    return StepManifest(step, items, files, processes, time, digest, written, reused, lane)


def read_manifest(step_loc: Location) -> StepManifest:
    """The validated manifest of a committed step (checksum checked)."""
    raw = step_loc.read_bytes(MANIFEST_FILE)
    if raw is None:
        raise CheckpointNotFoundError(f"{step_loc} is not a committed step (no {MANIFEST_FILE})")
    return _checked_manifest(step_loc, raw)


def _checked_manifest(step_loc: Location, raw: bytes) -> StepManifest:
    where = f"{step_loc}/{MANIFEST_FILE}"
    manifest = manifest_from_bytes(raw, where)
    if STEP_RE.match(step_loc.name) and manifest.step != int(step_loc.name):
        raise CorruptCheckpointError(
            f"{where}: field step: expected {int(step_loc.name)} (the directory's name), "
            f"found {manifest.step}"
        )
    _check_item_folders(step_loc, manifest)
    return manifest


def _check_item_folders(step_loc: Location, manifest: StepManifest) -> None:
    """On local disk, an item folder the manifest names must be a directory, never a link."""
    if not step_loc.is_local:
        return
    kinds = step_loc.child_kinds()
    for name, entry in manifest.items.items():
        kind = kinds.get(entry.dir, "dir")
        if kind != "dir":
            raise ForeignEntryError(
                f"{step_loc.child(entry.dir)}: the folder of item {name!r} of step "
                f"{manifest.step}: expected a directory written by this library, found a "
                f"{'symbolic link' if kind == 'symlink' else kind} (never followed or read)"
            )


def manifest_for_item(item_loc: Location) -> StepManifest | None:
    """The manifest of the step holding ``item_loc`` (None when its parent is no step)."""
    parent = item_loc.parent
    raw = parent.read_bytes(MANIFEST_FILE)  # read once: absent, or the manifest checked
    if raw is None:
        return None
    manifest = _checked_manifest(parent, raw)
    if item_loc.name not in {e.dir for e in manifest.items.values()}:
        return None
    return manifest


def read_item_json(item_loc: Location, name: str) -> object:
    """A JSON file of a step's item, checked against the checksum in the step manifest."""
    where = f"{item_loc}/{name}"
    manifest = manifest_for_item(item_loc)
    if manifest is None:
        raise CorruptCheckpointError(f"{where}: not inside a committed step")
    raw = read_listed(item_loc, name, listed=item_checksums(manifest, item_loc.name))
    return _local_files.parse(raw, where, _local_files.JSON_ITEM)


def committed_checksums(location: Location) -> dict[str, str] | None:
    """The sha256 of each JSON file at ``location`` its commit recorded; None if uncommitted."""
    raw_marker = location.read_bytes(COMMIT_FILE)
    if raw_marker is not None:
        return dict(CommitMarker.from_bytes(raw_marker, f"{location}/{COMMIT_FILE}").files)
    manifest = manifest_for_item(location)
    if manifest is None:
        return None
    return item_checksums(manifest, location.name)


def item_checksums(manifest: StepManifest, item_dir: str) -> dict[str, str]:
    """The sha256 of each JSON file of the item in folder ``item_dir``, by name."""
    prefix = f"{item_dir}/"
    return {k[len(prefix) :]: v for k, v in manifest.files.items() if k.startswith(prefix)}


def read_listed(location: Location, name: str, *, listed: dict[str, str]) -> bytes:
    """The JSON file ``name`` of a committed checkpoint, checked against ``listed``."""
    where = f"{location}/{name}"
    expected = listed.get(name)
    if expected is None:
        raise CorruptCheckpointError(
            f"{where}: the commit records no checksum for it (not a file of this item, "
            f"or the file list was damaged)"
        )
    raw = location.read_bytes(name)
    if raw is None:
        raise CorruptCheckpointError(f"{location} is committed but {name} is missing")
    return _checked(raw, where, expected)


def read_listed_document(location: Location, listed: dict[str, str]) -> CheckpointDocument:
    """The validated metadata at ``location``, checked against ``listed`` (kept on it)."""
    where = f"{location}/{METADATA_FILE}"
    raw = read_listed(location, METADATA_FILE, listed=listed)
    doc = document_from_json(_local_files.parse(raw, where, _local_files.METADATA), where)
    return dataclasses.replace(doc, listed=listed)


@dataclasses.dataclass(frozen=True)
class LeafMetadata:
    """What is known about one saved leaf without reading its data."""

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str | None
    sharding: dict[str, Any] | None
    nbytes: int


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """Result of :func:`flax_orbax_plugin.metadata`: the leaves of a checkpoint.

    ``kind``: ``"pytree"``, or the kind of a step's item that holds a JSON value
    (``"json"``, ``"step"``, ``"data_iterator"``): no leaves, ``fop.restore`` returns
    the value (``format_version`` is then the step manifest's)."""

    path: str
    format_version: int
    created_at: float
    process_count: int
    leaves: dict[str, LeafMetadata]
    kind: str = "pytree"

    @property
    def total_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values())


def to_public(doc: CheckpointDocument, path: str) -> CheckpointMetadata:
    leaves = {
        r.path: LeafMetadata(r.path, r.kind, r.shape, r.dtype, r.sharding, r.nbytes)
        for r in doc.leaves
    }
    return CheckpointMetadata(path, doc.format_version, doc.created_at, doc.process_count, leaves)
