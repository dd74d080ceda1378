"""The on-disk layout, format version 1: typed records for every JSON file.

This package is the only place that knows the JSON field names and the names on disk
(``names``). Every record has ``to_json()`` and a ``from_json(obj, where)`` that
validates every field and raises :class:`CorruptCheckpointError` naming the file and
the field, before anything sized by the untrusted numbers is allocated (``checked``).
FORMAT.md at the repository root is the specification; later format versions restore
version 1. Files: ``_METADATA.json`` (:class:`CheckpointDocument`, ``checkpoint``),
``_COMMITTED`` (:class:`CommitMarker`) and ``_CHECKPOINT.json`` (:class:`StepManifest`,
both in ``markers``); leaf and batch records in ``records``; dtypes in ``dtypes``.
"""

from __future__ import annotations

from .checked import (
    decode,
    decode_checked,
    encode,
    is_safe_name,
    parse_sealed,
    seal,
    sha256,
    sha256_mismatch,
)
from .checkpoint import (
    CheckpointDocument,
)
from .dtypes import (
    DTYPES,
    EMPTY_KINDS,
    KEY_KINDS,
    LEAF_KINDS,
    MAX_ARRAY_BYTES,
    MAX_JSON_BYTES,
    MAX_NDIM,
    MAX_PROCESSES,
    MAX_TEXT_BYTES,
    NO_DATA_KINDS,
    PRNG_IMPLS,
    PRNG_KEY_WORDS,
    SCALAR_KINDS,
    SUPPORTED_DTYPES,
    TEXT_KINDS,
    dtype_from_name,
    dtype_name,
    packable,
    packed_bytes,
    zarr_dtype,
)
from .markers import (
    CommitMarker,
    ItemEntry,
    StepManifest,
)
from .names import (
    ARRAYS_DIR,
    BATCHES_DIR,
    COMMIT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    JSON_VALUE_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
    STEP_FORMAT,
    STEP_VERSION,
    array_dir,
    batch_dir,
    batch_name,
    iterator_state_file,
)
from .records import (
    ArrayStorage,
    BatchRecord,
    BatchStorage,
    LeafRecord,
    check_codec,
    text_bytes,
    text_value,
)

__all__ = [
    "ARRAYS_DIR",
    "ArrayStorage",
    "BATCHES_DIR",
    "BatchRecord",
    "BatchStorage",
    "COMMIT_FILE",
    "CheckpointDocument",
    "CommitMarker",
    "EMPTY_KINDS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ItemEntry",
    "JSON_VALUE_FILE",
    "KEY_KINDS",
    "LEAF_KINDS",
    "LeafRecord",
    "MANIFEST_FILE",
    "DTYPES",
    "MAX_ARRAY_BYTES",
    "MAX_JSON_BYTES",
    "MAX_NDIM",
    "MAX_PROCESSES",
    "MAX_TEXT_BYTES",
    "METADATA_FILE",
    "NO_DATA_KINDS",
    "PRNG_IMPLS",
    "PRNG_KEY_WORDS",
    "SCALAR_KINDS",
    "STEP_FORMAT",
    "STEP_VERSION",
    "SUPPORTED_DTYPES",
    "StepManifest",
    "TEXT_KINDS",
    "array_dir",
    "batch_dir",
    "batch_name",
    "check_codec",
    "decode",
    "decode_checked",
    "dtype_from_name",
    "dtype_name",
    "encode",
    "is_safe_name",
    "iterator_state_file",
    "parse_sealed",
    "seal",
    "sha256",
    "sha256_mismatch",
    "packable",
    "packed_bytes",
    "text_bytes",
    "zarr_dtype",
    "text_value",
]
