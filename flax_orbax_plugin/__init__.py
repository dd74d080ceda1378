"""flax_orbax_plugin: fast, safe, sharded checkpointing for Flax/Optax training loops.

The core (one pytree):

    fop.save(path, tree)                 # durable and committed on return
    handle = fop.save_async(path, tree)  # returns after the host snapshot; handle.wait()
    tree = fop.restore(path, like=None)  # like: arrays / ShapeDtypeStructs / None -> numpy
    info = fop.metadata(path)            # leaves, shapes, dtypes, shardings; no data read
"""

from ._callback import CheckpointCallback
from ._checkpointables import Checkpointable
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    ForeignEntryError,
    NotCommittedError,
    StepDeletedError,
    StructureError,
)
from ._manager import CheckpointManager, SaveFigures, UnknownItemError, restore_params
from ._metadata import CheckpointMetadata, LeafMetadata
from ._restore import metadata, restore
from ._save import SaveHandle, SaveResult, is_committed, save, save_async

__all__ = [
    "CheckpointCallback",
    "SaveFigures",
    "CheckpointError",
    "CheckpointManager",
    "Checkpointable",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CoordinationError",
    "CorruptCheckpointError",
    "ForeignEntryError",
    "LeafMetadata",
    "NotCommittedError",
    "SaveHandle",
    "SaveResult",
    "StepDeletedError",
    "StructureError",
    "UnknownItemError",
    "is_committed",
    "metadata",
    "restore",
    "restore_params",
    "save",
    "save_async",
]
