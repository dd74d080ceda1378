"""The checkpoint's JSON metadata: format, leaves, storage layout.

A committed checkpoint directory holds::

    _METADATA.json   format name and version, one record per leaf
    _COMMITTED       the commit marker, written last
    d/<i>/           zarr3 array of leaf number i (large or sharded leaves)
    b/<p>.<dtype>/   zarr3 1-D batch of small leaves of one dtype written by process p

Storage names are derived from leaf numbers, process numbers and dtype names,
never from user keys, so a key such as ``../x`` cannot escape the checkpoint.
Nothing here is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 & friends with numpy)
import numpy as np

from ._errors import CorruptCheckpointError, StructureError

FORMAT_NAME = "flax_orbax_plugin"
FORMAT_VERSION = 1
METADATA_FILE = "_METADATA.json"
COMMIT_FILE = "_COMMITTED"

# dtypes zarr3 (as tensorstore implements it) stores, by numpy name.
SUPPORTED_DTYPES = frozenset(
    "bool int4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 float8_e4m3fn "
    "float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 float8_e5m2fnuz float16 bfloat16 "
    "float32 float64 complex64 complex128".split()
)

LEAF_KINDS = (
    "array",
    "none",
    "py_int",
    "py_float",
    "py_bool",
    "py_complex",
    "np_scalar",
    "prng_key",
    "empty_dict",  # an empty node ({}, a NamedTuple or dataclass without fields)
    "empty_list",  # an empty list or tuple
)
EMPTY_KINDS = ("empty_dict", "empty_list")
NO_DATA_KINDS = ("none", *EMPTY_KINDS)  # records without shape, dtype or storage


@functools.lru_cache(maxsize=256)
def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached (numpy computes it anew on every access)."""
    return dtype.name


def dtype_from_name(name: str, *, path: str = "?") -> np.dtype:
    """numpy dtype for a stored dtype name; a clear error for unknown names."""
    if name not in SUPPORTED_DTYPES:
        raise StructureError(
            f"leaf {path!r}: unknown dtype {name!r} in checkpoint "
            f"(expected one of {sorted(SUPPORTED_DTYPES)})"
        )
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def describe_sharding(sharding: Any) -> dict[str, Any] | None:
    """A JSON description of a jax sharding (informational; restore uses ``like``)."""
    if sharding is None:
        return None
    return _describe_sharding(sharding)


@functools.lru_cache(maxsize=1024)
def _describe_sharding(sharding: Any) -> dict[str, Any]:
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = []
        for entry in sharding.spec:
            if entry is None or isinstance(entry, str):
                spec.append(entry)
            else:
                spec.append(list(entry))
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
    """Result of :func:`flax_orbax_plugin.metadata`: the leaves of a checkpoint."""

    path: str
    format_version: int
    created_at: float
    process_count: int
    leaves: dict[str, LeafMetadata]

    @property
    def total_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values())


def new_document(leaf_records: list[dict[str, Any]], batches: dict[str, dict]) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_at": time.time(),
        "process_count": jax.process_count(),
        "jax_version": jax.__version__,
        "leaves": leaf_records,
        "batches": batches,
    }


def _require(cond: bool, what: str, where: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"malformed metadata in {where}: {what}")


def validate_document(doc: Any, where: str) -> dict[str, Any]:
    """Checks the structure of a metadata document read from an untrusted store."""
    _require(isinstance(doc, dict), "not a JSON object", where)
    _require(doc.get("format") == FORMAT_NAME, f"format is {doc.get('format')!r}", where)
    version = doc.get("format_version")
    _require(isinstance(version, int), "format_version missing", where)
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where} has format_version {version}; this version of flax_orbax_plugin "
            f"reads up to {FORMAT_VERSION}"
        )
    leaves = doc.get("leaves")
    _require(isinstance(leaves, list), "leaves is not a list", where)
    batches = doc.get("batches")
    _require(isinstance(batches, dict), "batches is not an object", where)
    for i, rec in enumerate(leaves):
        _require(isinstance(rec, dict), f"leaf {i} is not an object", where)
        _require(isinstance(rec.get("path"), str), f"leaf {i} has no path", where)
        _require(rec.get("kind") in LEAF_KINDS, f"leaf {rec['path']!r}: bad kind", where)
        keys = rec.get("keys")
        _require(
            isinstance(keys, list)
            and all(
                isinstance(k, list)
                and len(k) == 2
                and k[0] in ("dict", "seq", "attr", "flat")
                and (isinstance(k[1], str) or (isinstance(k[1], int) and k[1] >= 0))
                and (k[0] in ("dict", "attr") or isinstance(k[1], int))
                for k in keys
            ),
            f"leaf {rec['path']!r}: bad keys",
            where,
        )
        if rec["kind"] in NO_DATA_KINDS:
            continue
        shape = rec.get("shape")
        _require(
            isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape),
            f"leaf {rec['path']!r}: bad shape",
            where,
        )
        _require(isinstance(rec.get("dtype"), str), f"leaf {rec['path']!r}: bad dtype", where)
        storage = rec.get("storage")
        _require(isinstance(storage, dict), f"leaf {rec['path']!r}: no storage", where)
        if storage.get("type") == "array":
            chunk = storage.get("chunk_shape")
            _require(
                isinstance(chunk, list)
                and len(chunk) == len(shape)
                and all(isinstance(c, int) and c >= 1 for c in chunk),
                f"leaf {rec['path']!r}: bad chunk_shape",
                where,
            )
        else:
            _require(storage.get("type") == "batch", f"leaf {rec['path']!r}: bad storage", where)
            _require(storage.get("batch") in batches, f"leaf {rec['path']!r}: bad batch", where)
            for key in ("offset", "size"):
                _require(
                    isinstance(storage.get(key), int) and storage[key] >= 0,
                    f"leaf {rec['path']!r}: bad {key}",
                    where,
                )
    for name, batch in batches.items():
        _require(isinstance(batch, dict), f"batch {name!r} not an object", where)
        _require(batch.get("dtype") in SUPPORTED_DTYPES, f"batch {name!r}: bad dtype", where)
        _require(
            isinstance(batch.get("process"), int) and batch["process"] >= 0,
            f"batch {name!r}: bad process",
            where,
        )
        _require(name == batch_name(batch["process"], batch["dtype"]), f"bad batch {name!r}", where)
        for key in ("size", "chunk"):
            _require(
                isinstance(batch.get(key), int) and batch[key] >= 1,
                f"batch {name!r}: bad {key}",
                where,
            )
    return doc


def batch_name(process: int, dtype: str) -> str:
    return f"{process}.{dtype}"


def to_public(doc: dict[str, Any], path: str) -> CheckpointMetadata:
    leaves = {}
    for rec in doc["leaves"]:
        shape = tuple(rec.get("shape", ()))
        dtype = rec.get("dtype")
        nbytes = 0
        if dtype is not None:
            itemsize = dtype_from_name(dtype, path=rec["path"]).itemsize
            nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        leaves[rec["path"]] = LeafMetadata(
            path=rec["path"],
            kind=rec["kind"],
            shape=shape,
            dtype=dtype,
            sharding=rec.get("sharding"),
            nbytes=nbytes,
        )
    return CheckpointMetadata(
        path=path,
        format_version=doc["format_version"],
        created_at=float(doc.get("created_at", 0.0)),
        process_count=int(doc.get("process_count", 1)),
        leaves=leaves,
    )
