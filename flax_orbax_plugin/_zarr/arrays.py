"""zarr3 arrays through tensorstore: the on-disk form of array data (every chunk with a
crc32c; chunks divide the shard shape, so no two writers touch one), and format version
2's compressed segments coded over a private ``memory`` kvstore. Any thread.
"""

from __future__ import annotations

import errno
import re
from typing import Any

import numpy as np
import tensorstore as ts

from .._format.layout import (
    DTYPES,
    BatchRecord,
    LeafRecord,
    array_dir,
    batch_dir,
    dtype_from_name,
)
from .._storage.location import Location, context
from . import chunks as _chunks
from . import subbyte as _subbyte

CHUNK_TARGET_BYTES = 4 << 20  # large leaves: chunks of at most ~4 MiB (restore peak memory)
# batches of small leaves: one file per ~16 MiB (its inner chunks: BatchRecord.inner)
BATCH_CHUNK_BYTES = 16 << 20


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in small]


def chunk_shape(
    shard_shape: tuple[int, ...],
    itemsize: int,
    *,
    must_divide: bool,
    target: int | None = None,
) -> list[int]:
    """A chunk of at most ~``target`` bytes (``must_divide``: dividing ``shard_shape``)."""
    target = target or CHUNK_TARGET_BYTES
    chunk = [max(1, s) for s in shard_shape]
    for axis in range(len(chunk)):
        rest = itemsize * int(np.prod(chunk[axis + 1 :], dtype=np.int64))
        if rest * chunk[axis] <= target:
            break
        if must_divide:
            best = max((d for d in _divisors(chunk[axis]) if rest * d <= target), default=1)
            if rest * best * 16 < target and best < chunk[axis]:
                break  # only tiny divisors: keep this axis whole
            chunk[axis] = best
        else:
            # As many chunks as ~target bytes need, then balanced: the array's end cuts
            # the last chunk by less than one row each (zarr3 stores an edge chunk
            # whole, zero-padded: 1365-row chunks of 3072 rows stored 4095 rows).
            count = -(-chunk[axis] // max(1, target // rest))
            chunk[axis] = -(-chunk[axis] // count)
        if rest * chunk[axis] <= target:
            break
    return [int(c) for c in chunk]


def spec(
    location: Location,
    sub: str,
    shape,
    dtype_name: str,
    chunk: list[int],
    itemsize: int,
    *,
    inner_chunk: list[int] | None = None,
    codec: str | None = None,
) -> dict[str, Any]:
    """zarr3 spec; with ``inner_chunk`` each chunk is one file of checksummed inner chunks
    (sharding codec). ``codec`` ``"zstd:<level>"`` compresses each before its checksum."""
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    codecs: list[dict[str, Any]] = [bytes_codec]
    if codec is not None:
        name, _, level = codec.partition(":")
        codecs.append({"name": name, "configuration": {"level": int(level)}})
    codecs.append({"name": "crc32c"})
    if inner_chunk is not None:
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": inner_chunk,
                    "codecs": codecs,
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_location": "end",
                },
            }
        ]
    return {
        "driver": "zarr3",
        "kvstore": location.kvstore(sub),
        "metadata": {
            "shape": [int(s) for s in shape],
            "data_type": DTYPES[dtype_name].zarr,  # a stand-in where tensorstore has none
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": codecs,
        },
    }


def as_stored(data: np.ndarray, stored: np.dtype) -> np.ndarray:
    """``data`` viewed (no copy) as the zarr3 ``data_type`` ``stored`` its array has."""
    return data if data.dtype == stored else data.view(stored)


def _context_for(array_spec: dict[str, Any]) -> ts.Context:
    return context(local=array_spec["kvstore"]["driver"] == "file")


def create(array_spec: dict[str, Any]) -> ts.Future:
    """Writes the array's zarr.json (primary process only)."""
    return ts.open(array_spec, create=True, open=True, context=_context_for(array_spec))


def open_for_write(array_spec: dict[str, Any]) -> ts.TensorStore:
    """Opens without touching stored metadata; every written chunk is stored."""
    array_spec = dict(array_spec, store_data_equal_to_fill_value=True)
    return ts.open(array_spec, assume_metadata=True, context=_context_for(array_spec)).result()


def open_for_read(array_spec: dict[str, Any]) -> ts.Future:
    """Starts opening, checking ``zarr.json`` against ``array_spec``; a missing chunk raises."""
    array_spec = dict(array_spec, fill_missing_data_reads=False)
    return ts.open(array_spec, open=True, context=_context_for(array_spec))


# Statuses that prove the stored bytes are wrong or absent: a checksum (DATA_LOSS), a
# size or a zarr.json that disagrees (FAILED_PRECONDITION), bytes that do not decode
# (INVALID_ARGUMENT, OUT_OF_RANGE), a chunk that is not there (NOT_FOUND).
_DAMAGE = frozenset(
    {"DATA_LOSS", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND"}
)
_STATUS = re.compile(r"^([A-Z_]+): ")
_OS_CODE = re.compile(r"\[os_error_code='?(\d+)'?\]")
_DAMAGE_ERRNOS = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR})
_STATUS_ERRNO = {
    "DEADLINE_EXCEEDED": errno.ETIMEDOUT,  # TimeoutError
    "PERMISSION_DENIED": errno.EACCES,  # PermissionError
    "UNAUTHENTICATED": errno.EACCES,
    "UNAVAILABLE": errno.ECONNREFUSED,  # ConnectionRefusedError
    "RESOURCE_EXHAUSTED": errno.ENOMEM,
}


def environmental(error: BaseException) -> OSError | None:
    """The :class:`OSError` a tensorstore ``error`` stands for when it is the environment's
    fault (proving nothing about the bytes); None when it proves damage or is no status."""
    if isinstance(error, OSError):
        return error
    if not isinstance(error, ValueError):
        return None
    text = str(error)
    status = _STATUS.match(text)
    if status is None:
        return None  # not tensorstore's (our own checks raise plain ValueError)
    code = _OS_CODE.search(text)
    os_errno = int(code.group(1)) if code else None
    if os_errno is not None:
        if os_errno in _DAMAGE_ERRNOS:
            return None
    elif status.group(1) in _DAMAGE:
        return None
    shown = text.split(" [tensorstore_spec=", 1)[0]
    return OSError(os_errno or _STATUS_ERRNO.get(status.group(1), errno.EIO), shown)


def leaf_spec(root: Location, index: int, record: LeafRecord) -> dict[str, Any]:
    """The spec of leaf number ``index``'s own array under ``root`` (packed: its bytes)."""
    record = _subbyte.stored(record)
    itemsize = dtype_from_name(record.dtype, path=record.path).itemsize
    shape, chunk, codec = record.shape, record.storage.chunk_shape, record.storage.codec
    return spec(root, array_dir(index), shape, record.dtype, chunk, itemsize, codec=codec)


def batch_spec(root: Location, batch: BatchRecord) -> dict[str, Any]:
    """The spec of the batch array ``b/<name>`` under ``root``."""
    itemsize, chunk = dtype_from_name(batch.dtype).itemsize, [int(batch.chunk)]
    sub, inner = batch_dir(batch.name), [batch.inner]
    return spec(
        root, sub, [batch.size], batch.dtype, chunk, itemsize, inner_chunk=inner, codec=batch.codec
    )


MEMORY = Location.from_path("memory://")  # the root the specs below are built under
_ZARR_JSON = b"zarr.json"


def max_segment_bytes(raw_bytes: int, inner_chunks: int = 1) -> int:
    """The most bytes a compressed segment of ``raw_bytes`` decoded bytes may hold."""
    frames = raw_bytes + raw_bytes // 128 + inner_chunks * (1024 + _chunks.CRC_BYTES)
    return frames + 16 * inner_chunks + _chunks.CRC_BYTES


def encode(spec: dict[str, Any], writes: list[tuple[Any, np.ndarray]]) -> list[tuple[str, Any]]:
    """``[(key inside the array, stored bytes)]`` of every chunk of ``writes``, sorted."""
    context = ts.Context()
    spec = dict(spec, store_data_equal_to_fill_value=True)
    store = ts.open(spec, create=True, open=True, context=context).result()
    for index, data in writes:
        store[index].write(as_stored(data, store.dtype.numpy_dtype)).result()
    kv = ts.KvStore.open(spec["kvstore"], context=context).result()
    out = []
    for key in sorted(kv.list().result()):
        if key != _ZARR_JSON:
            out.append((key.decode("ascii"), kv.read(key).result().value))
    return out


class Decoder:
    """A zarr3 array of ``spec`` (under :data:`MEMORY`) in its own memory: :meth:`put` each
    stored chunk a read needs, then read :attr:`store` (a chunk not put is an error)."""

    def __init__(self, spec: dict[str, Any]):
        self._context = ts.Context()
        spec = dict(spec, fill_missing_data_reads=False)
        self.store = ts.open(spec, create=True, context=self._context).result()
        self._kv = ts.KvStore.open(spec["kvstore"], context=self._context).result()

    def put(self, key: str, data: Any) -> None:
        """Stores ``data`` (bytes of one segment) as the chunk ``key`` (``c/...``)."""
        self._kv.write(key, bytes(data)).result()
