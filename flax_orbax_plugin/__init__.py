"""flax_orbax_plugin: fast, safe, sharded checkpointing for Flax/Optax training loops.

The core (one pytree):

    fop.save(path, tree)                 # durable and committed on return
    handle = fop.save_async(path, tree)  # returns after the host snapshot; handle.wait()
    tree = fop.restore(path, like=None)  # like: arrays / ShapeDtypeStructs / None -> numpy
    info = fop.metadata(path)            # leaves, shapes, dtypes, shardings; no data read
"""

from ._callback import CheckpointCallback, SaveFigures
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    NotCommittedError,
    StructureError,
)
from ._metadata import CheckpointMetadata, LeafMetadata
from ._restore import metadata, restore
from ._save import SaveHandle, SaveResult, is_committed, save, save_async

__all__ = [
    "CheckpointCallback",
    "SaveFigures",
    "CheckpointError",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CoordinationError",
    "CorruptCheckpointError",
    "LeafMetadata",
    "NotCommittedError",
    "SaveHandle",
    "SaveResult",
    "StructureError",
    "is_committed",
    "metadata",
    "restore",
    "save",
    "save_async",
]
