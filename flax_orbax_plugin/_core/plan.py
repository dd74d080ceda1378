"""The layout of one save (a record per leaf, the batches of small leaves) and its host copy.

Call order: :meth:`Plan.build` (identical on every process) and :meth:`Plan.snapshot` on
the caller's thread, then :meth:`Snapshot.write` once on one background thread.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import threading
import time
from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import env as _env
from .._base import host as _host
from .._base import host_memory as _host_memory
from .._base import tree as _tree
from .._errors import StructureError
from .._format import layout as _layout
from .._format.layout import (
    METADATA_FILE,
    ArrayStorage,
    BatchRecord,
    BatchStorage,
    CheckpointDocument,
    LeafRecord,
)
from .._incremental import reuse as _reuse
from .._storage import local_files as _local_files
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunks as _chunks
from .._zarr import packed_writer as _packed_writer
from .._zarr import subbyte as _subbyte
from . import device_copy as _device_copy
from . import formats as _formats
from . import host_snapshot as _host_snapshot
from .formats import SaveRequest


def _text(path: str, leaf: str | bytes) -> str:
    """A str or bytes leaf as the record's JSON string (bytes base64), bounded."""
    raw = _utf8(leaf, f"leaf {path!r}: a str") if isinstance(leaf, str) else leaf
    if len(raw) > _layout.MAX_TEXT_BYTES:
        raise StructureError(
            f"leaf {path!r}: a {type(leaf).__name__} of {len(raw)} bytes; the metadata keeps at "
            f"most {_layout.MAX_TEXT_BYTES} of a str or bytes leaf (store more as a uint8 array)"
        )
    return leaf if isinstance(leaf, str) else base64.b64encode(raw).decode("ascii")


def _utf8(text: str, what: str) -> bytes:
    """``text`` in UTF-8; StructureError naming ``what`` for a lone surrogate."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StructureError(
            f"{what} that UTF-8 cannot encode: {e.reason} ({text[e.start : e.end]!r} at "
            f"character {e.start}); a checkpoint's metadata holds UTF-8 text only"
        ) from None


_PER_LEAF = len('{"path":"","keys":[],"kind":""}')  # a leaf record's bytes beside its path


def _check_document_size(nbytes: int, leaves: int, text_leaves: int) -> None:
    """A lower bound of ``_METADATA.json``'s size, refused before anything is staged."""
    limit = _local_files.METADATA.max_bytes
    if nbytes > limit:
        raise StructureError(
            f"{_layout.METADATA_FILE} of this tree would hold over {nbytes} bytes ({leaves} "
            f"leaves, {text_leaves} str or bytes), past a reader's {limit}: save less text"
        )


def _check_live(path: str, leaf: jax.Array) -> None:
    """A traced value or a deleted (donated) array holds nothing to save: named here."""
    if isinstance(leaf, jax.core.Tracer):
        raise StructureError(
            f"leaf {path!r}: expected a concrete array, found a traced value (inside "
            f"jax.jit, grad or vmap): save outside the transformed function, from its output"
        )
    if leaf.is_deleted():
        raise StructureError(
            f"leaf {path!r}: expected a live array, found one that was deleted (donated "
            f"to a jitted step with donate_argnums, or .delete()d): save the state the "
            f"step returned, or before the step that donates it"
        )


def classify(path: str, leaf: Any) -> tuple[str, Any, str | None]:
    """(kind, array-like value, PRNG impl) for one leaf; errors name the path."""
    if leaf is None:
        return "none", None, None
    if isinstance(leaf, jax.Array):
        _check_live(path, leaf)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(leaf))
            return "prng_key", jax.random.key_data(leaf), impl
        return "array", leaf, None
    if isinstance(leaf, np.generic):  # before float: np.float64 is a float, kept numpy
        return "np_scalar", native_order(np.asarray(leaf)), None
    if isinstance(leaf, bool):
        return "py_bool", np.asarray(leaf, dtype=np.bool_), None
    if isinstance(leaf, int):
        if not -(2**63) <= leaf < 2**63:
            raise StructureError(f"leaf {path!r}: expected an int that fits int64, found {leaf}")
        return "py_int", np.asarray(leaf, dtype=np.int64), None
    if isinstance(leaf, float):
        return "py_float", np.asarray(leaf, dtype=np.float64), None
    if isinstance(leaf, complex):
        return "py_complex", np.asarray(leaf, dtype=np.complex128), None
    if isinstance(leaf, np.ndarray):
        if isinstance(leaf, np.ma.MaskedArray):
            raise StructureError(
                f"leaf {path!r}: expected a plain numpy array, found a masked array (its mask "
                "would be lost): save .data and .mask as two leaves, or np.ma.filled(...) it"
            )
        return "array", native_order(leaf), None
    if isinstance(leaf, str | bytes):
        return "py_str" if isinstance(leaf, str) else "py_bytes", _text(path, leaf), None
    if _tree.is_empty_node(leaf):
        return _tree.empty_kind(leaf), None, None
    raise StructureError(
        f"leaf {path!r}: expected a jax.Array, numpy array, scalar, str, bytes or None, "
        f"found {type(leaf).__module__}.{type(leaf).__qualname__}"
    )


def native_order(value: np.ndarray) -> np.ndarray:
    """``value`` in this host's byte order (a big-endian array is converted)."""
    if value.dtype.isnative:
        return value
    return value.astype(value.dtype.newbyteorder("="))


@functools.lru_cache(maxsize=4096)
def _first_device(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> jax.Device:
    return next(iter(sharding.devices_indices_map(shape)))


SMALL_LEAF_BYTES = 1 << 20  # unpartitioned leaves up to this size are batched


@dataclasses.dataclass
class Leaf:
    index: int
    value: Any  # jax.Array / np.ndarray / None, after scalar and key conversion
    record: LeafRecord
    writes: list[tuple[tuple[slice, ...], np.ndarray]] = dataclasses.field(default_factory=list)
    crcs: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)  # as copied
    value_digest: str | None = None  # a small host value's (compared across processes)


class _Batching:
    """The batches of small leaves being planned: each leaf's aligned slot."""

    def __init__(self):
        self.sizes: dict[str, int] = {}  # batch name -> elements used so far
        self.kinds: dict[str, tuple[str, int, int]] = {}  # batch name -> (dtype, process, chunk)

    def slot(self, process: int, name: str, dtype: np.dtype, nbytes: int) -> BatchStorage:
        batch = _layout.batch_name(process, name)
        self.kinds.setdefault(
            batch, (name, process, max(1, _arrays.BATCH_CHUNK_BYTES // dtype.itemsize))
        )
        size = nbytes // dtype.itemsize
        align = max(1, _host.ALIGNMENT // dtype.itemsize)  # zero-copy on restore
        offset = -(-self.sizes.get(batch, 0) // align) * align
        self.sizes[batch] = offset + size
        return BatchStorage(batch, offset, size)

    def records(self, codec: str | None) -> dict[str, BatchRecord]:
        batches = {}
        for batch, (dtype, process, chunk) in self.kinds.items():
            size = max(1, self.sizes.get(batch, 0))
            chunk = min(chunk, 1 << (size - 1).bit_length())  # small: stored whole, as it is
            batches[batch] = BatchRecord(batch, dtype, process, size, chunk, codec)
        return batches


def _data_record(path, keys, kind, value, impl, codec, batching: _Batching) -> LeafRecord:
    """A batch slot when small and unpartitioned, else an array of its own."""
    dtype = np.dtype(value.dtype)
    name = _layout.dtype_name(dtype)
    if name not in _layout.SUPPORTED_DTYPES:
        raise StructureError(
            f"leaf {path!r}: expected a dtype in {sorted(_layout.SUPPORTED_DTYPES)}, found {dtype}"
        )
    shape = tuple(int(s) for s in value.shape)
    sharding = value.sharding if isinstance(value, jax.Array) else None
    nbytes = math.prod(shape) * dtype.itemsize
    partitioned = sharding is not None and not sharding.is_fully_replicated
    if nbytes <= SMALL_LEAF_BYTES and not partitioned:
        process = 0 if sharding is None else _first_device(sharding, shape).process_index
        if _layout.DTYPES[name].bits < 8 and shape and 0 not in shape:  # its packed bytes
            packed = _layout.packed_bytes(name, math.prod(shape))
            slot = batching.slot(process, "uint8", np.dtype(np.uint8), packed)
            storage: Any = dataclasses.replace(slot, packed=True)
        else:
            storage = batching.slot(process, name, dtype, nbytes)
    else:
        shard_shape = sharding.shard_shape(shape) if sharding is not None else shape
        chunk = _arrays.chunk_shape(shard_shape, dtype.itemsize, must_divide=partitioned)
        storage = ArrayStorage(tuple(chunk), codec, _layout.packable(name, shape, chunk))
    return LeafRecord(path, keys, kind, shape, name, describe_sharding(sharding), storage, impl)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The layout of one save, identical on every process; :meth:`snapshot` once."""

    leaves: list[Leaf]
    batches: dict[str, BatchRecord]
    request: SaveRequest
    format: _formats.Format
    digest: str

    @classmethod
    def build(cls, tree: Any, request: SaveRequest) -> Plan:
        codec = request.compression
        flat, _ = _tree.flatten(tree)
        leaves: list[Leaf] = []
        batching = _Batching()
        doc_bytes = text_leaves = 0
        compared = _distributed.process_count() > 1  # small host values: else unused
        for index, (path, keys, raw) in enumerate(flat):
            kind, value, impl = classify(path, raw)
            keys = tuple(keys)
            text = value if kind in _layout.TEXT_KINDS else None  # kept in the record
            if not path.isascii():
                _utf8(path, f"leaf path {path!r}: a key")
            doc_bytes += _PER_LEAF + len(path)
            if text is not None:
                text_leaves += 1
                doc_bytes += len(json.dumps(text))  # as the record holds it (escaped)
            if kind in _layout.NO_DATA_KINDS:
                leaves.append(Leaf(index, None, LeafRecord(path, keys, kind, value=text)))
                continue
            record = _data_record(path, keys, kind, value, impl, codec, batching)
            shown = None  # a small host value's digest, compared across processes
            if compared and isinstance(value, np.ndarray) and value.nbytes <= 1 << 16:
                shown = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:12]
            leaves.append(Leaf(index, value, record, value_digest=shown))
        _check_document_size(doc_bytes, len(flat), text_leaves)
        version = _formats.for_version(request.format_version)  # picked once, here
        return cls(leaves, batching.records(codec), request, version, _digest(leaves))

    def snapshot(self) -> Snapshot:
        """The blocking phase's copy of every byte this process writes."""
        req = self.request
        budget = req.host_memory_budget
        pool = None if budget is not None else req.buffers
        batch_data, pooled = _host_snapshot.take_small(
            self.leaves, self.batches, pool, req.own_copy
        )
        big = [  # the leaves stored as arrays of their own (another process's small too)
            leaf
            for leaf in self.leaves
            if leaf.value is not None and not isinstance(leaf.record.storage, BatchStorage)
        ]
        on_device = [leaf for leaf in big if _host_snapshot.on_device(leaf.value)]
        kind = "none"
        if on_device:
            platform = next(iter(on_device[0].value.devices())).platform
            kind = "streamed" if budget is not None else _device_copy.staging_for(platform)
        note = ""
        if kind == "device":  # every jax.Array (a CPU one too) copied where it lives
            arrays = [leaf for leaf in big if isinstance(leaf.value, jax.Array)]
            copies, note = _device_copy.snapshot([leaf.value for leaf in arrays])
            if copies is None:
                kind = "host"  # the device lacks the memory: copied to host now, said why
            else:
                for leaf, copy in zip(arrays, copies, strict=True):
                    leaf.value = copy  # its own copy: no donation touches it
                for leaf in big:  # the caller may change a numpy array on return
                    if isinstance(leaf.value, np.ndarray):
                        leaf.value = leaf.value.copy()
        # the device staging: the host copy is the write's (from the device copy)
        write_first = kind != "device" and _take(self.leaves, self.batches, pool, req, kind, pooled)
        return Snapshot(
            self.leaves,
            self.batches,
            req,
            self.format,
            self.digest,
            batch_data,
            pool,
            pooled,
            _host_snapshot.Staging(kind, note),
            write_first,
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Snapshot:
    """This process's host copy of one save; ``write_first``: the save waits for its write."""

    leaves: list[Leaf]
    batches: dict[str, BatchRecord]
    request: SaveRequest
    format: _formats.Format
    digest: str
    batch_data: dict[str, np.ndarray | _packed_writer.Gathered]
    pool: _host_memory.BufferPool | None
    pooled: list[np.ndarray]  # taken from ``pool``, given back after write
    staging: _host_snapshot.Staging
    write_first: bool
    data_written: threading.Event = dataclasses.field(default_factory=threading.Event)

    def document(self) -> CheckpointDocument:
        return CheckpointDocument(
            tuple(leaf.record for leaf in self.leaves),
            self.batches,
            _distributed.process_count(),
            time.time() if self.request.created_at is None else self.request.created_at,
            jax.__version__,
            self.format.version,
        )

    def write(self, location: Location, *, durable: bool = True) -> _formats.Written:
        """Background phase: this process's chunks (the primary: the metadata too); no commit."""
        try:
            return self._write(location, durable=durable)
        finally:
            self.data_written.set()
            if self.pool is not None:  # tensorstore reads none of them any more
                self.pool.give_back(self.pooled)
            self.pooled.clear()
            for leaf in self.leaves:  # views of the state: jax may donate its buffers now
                leaf.writes = []
            self.batch_data.clear()

    def _write(self, location, *, durable) -> _formats.Written:
        if self.staging.kind == "device":  # the host copy, from the device copy
            _take(self.leaves, self.batches, self.pool, self.request, "fetch", self.pooled)
        primary = _distributed.is_primary() or self.request.own_copy
        reuse = self.request.reuse
        if self.format.copies_before_writing or reuse is not None:  # every region first
            _host_snapshot.materialize_all(self.leaves)
        found = None
        if reuse is not None:
            found = _reuse.unchanged(self.leaves, self.format, location, reuse, self.request.region)
        leaves, found = _stored_leaves(self.leaves, found)  # sub-byte leaves packed
        encoded: concurrent.futures.Future = concurrent.futures.Future()
        if primary:  # encoded while tensorstore's threads write the data
            threading.Thread(target=self._encode, args=(encoded,), daemon=True).start()
        written, files, reused = self.format.write(
            self, location, leaves, primary=primary, found=found
        )
        files = dict(files)
        self.data_written.set()  # a save under a budget may return now
        if primary:
            encoded = encoded.result()
            location.write_bytes(METADATA_FILE, encoded, durable=False)
            files[METADATA_FILE] = _layout.sha256(encoded)
            _env.kill_point("after_metadata")
        if durable:
            location.sync()
            _env.kill_point("after_sync")
        return _formats.Written(written, files, reused)

    def _encode(self, out: concurrent.futures.Future) -> None:
        try:
            doc = self.document().to_json()
            out.set_result(_local_files.encode(doc, METADATA_FILE, _local_files.METADATA))
        except BaseException as e:  # noqa: BLE001  (raised by the write that needs it)
            out.set_exception(e)


def _take(leaves, batches, pool, request: SaveRequest, kind: str, pooled: list) -> bool:
    more, write_first = _host_snapshot.take_regions(
        leaves, batches, pool, request.own_copy, request.host_memory_budget, device_kind=kind
    )
    pooled += more
    return write_first


def _stored_leaves(leaves: list[Leaf], found):
    """The leaves as stored (sub-byte ones packed), and ``found`` referring to them."""
    out, by_index = [], {}
    for leaf in leaves:
        if _chunks.is_packed(leaf.record):
            writes = [
                _subbyte.pack_write(leaf.record, index, _host_snapshot.materialize(data))
                for index, data in leaf.writes
            ]
            leaf = Leaf(leaf.index, leaf.value, _subbyte.stored(leaf.record), writes)
        out.append(leaf)
        by_index[leaf.index] = leaf
    if found is not None:
        way, source, unchanged = found
        found = way, source, [(by_index[leaf.index], j, chunks) for leaf, j, chunks in unchanged]
    return out, found


def _digest(leaves: list[Leaf]) -> str:
    """The tree's structure and the small values only the primary writes, digested."""
    h = hashlib.sha256()
    for leaf in leaves:
        r = leaf.record
        h.update(f"{r.path}\0{r.kind}\0{r.shape}\0{r.dtype}\n".encode())
        if r.value is not None:  # a str or bytes leaf: every process saves the same
            h.update(hashlib.sha256(r.value.encode("utf-8")).digest())
        elif leaf.value_digest is not None:
            h.update(leaf.value_digest.encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=1024)
def describe_sharding(sharding: Any) -> dict[str, Any] | None:
    """A JSON description of a jax sharding (informational; restore uses ``like``)."""
    if sharding is None:
        return None
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = [e if e is None or isinstance(e, str) else list(e) for e in sharding.spec]
        return {
            "type": "NamedSharding",
            "mesh_axis_names": list(sharding.mesh.axis_names),
            "mesh_shape": [int(s) for s in sharding.mesh.devices.shape],
            "spec": spec,
        }
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return {"type": "SingleDeviceSharding"}
    return {
        "type": type(sharding).__name__,
        "fully_replicated": bool(sharding.is_fully_replicated),
        "num_devices": len(sharding.device_set),
    }
