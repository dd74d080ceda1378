"""The names of format version 1 on disk: format ids, file names, array directories.

The only place that spells them: ``d/<i>`` (leaf i's own array), ``b/<p>.<dtype>``
(a batch of small leaves), ``process_<i>.json`` (a data iterator's state per
process), and the JSON files of a checkpoint and a step. Chunk names under an array
are zarr's (``_zarr.chunks``). FORMAT.md, "Names" and "A checkpoint", specifies them.
"""

from __future__ import annotations

FORMAT_NAME = "flax_orbax_plugin"
FORMAT_VERSION = 1
LATEST_FORMAT_VERSION = 2  # _METADATA.json: 1 (a file per chunk) or 2 (data files)
STEP_FORMAT = "flax_orbax_plugin/step"
STEP_VERSION = 1

METADATA_FILE = "_METADATA.json"
COMMIT_FILE = "_COMMITTED"
MANIFEST_FILE = "_CHECKPOINT.json"
JSON_VALUE_FILE = "value.json"
ARRAYS_DIR = "d"  # d/<i>/: the zarr3 array of leaf number i
BATCHES_DIR = "b"  # b/<name>/: a zarr3 1-D batch of small leaves


def array_dir(index: int) -> str:
    """``d/<i>``: where leaf number ``index`` is stored as its own array."""
    return f"{ARRAYS_DIR}/{int(index)}"


def batch_dir(name: str) -> str:
    """``b/<name>``: where the batch ``name`` (:func:`batch_name`) is stored."""
    return f"{BATCHES_DIR}/{name}"


def batch_name(process: int, dtype: str) -> str:
    return f"{process}.{dtype}"


def iterator_state_file(process_index: int) -> str:
    """``process_<i>.json``: the data iterator state of process ``process_index``."""
    return f"process_{process_index}.json"
