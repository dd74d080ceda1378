"""The on-disk layout, format version 1: typed records for the JSON files of a checkpoint,
the only place that knows the JSON field names and the names on disk (FORMAT.md is the
specification). ``records``: the dtypes and the records as a writer makes them;
``read_back``: each record parsed from storage, every field checked first. Their names
that readers use are re-exported here (``X as X``).
"""

from __future__ import annotations

from .read_back import STEP_NAME as STEP_NAME
from .read_back import STEP_RE as STEP_RE
from .read_back import committed_checksums as committed_checksums
from .read_back import item_checksums as item_checksums
from .read_back import leaf_from_json as leaf_from_json
from .read_back import manifest_for_item as manifest_for_item
from .read_back import manifest_from_bytes as manifest_from_bytes
from .read_back import read_item_json as read_item_json
from .read_back import read_listed as read_listed
from .read_back import read_listed_document as read_listed_document
from .read_back import read_manifest as read_manifest
from .read_back import text_value as text_value
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
