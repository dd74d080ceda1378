"""flax_orbax_plugin: fast, safe, sharded checkpointing for Flax/Optax training loops.

The core (one pytree):

    fop.save(path, tree)                 # durable and committed on return
    handle = fop.save_async(path, tree)  # returns after the host snapshot; handle.wait()
    tree = fop.restore(path, like=None)  # like: arrays / ShapeDtypeStructs / None -> numpy
    info = fop.metadata(path)            # leaves, shapes, dtypes, shardings; no data read
    report = fop.verify(path)            # every checksum of a checkpoint or a directory

A directory of training steps: ``CheckpointManager``, ``CheckpointCallback``;
serving: ``restore_params``.
"""

from ._callback import CheckpointCallback
from ._checkpointables import Checkpointable, Pending, Written
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    DirectoryLockedError,
    NotCommittedError,
    StructureError,
    UnknownItemError,
)
from ._manager import CheckpointManager
from ._metadata import CheckpointMetadata, LeafMetadata
from ._restore import metadata, restore
from ._save import SaveHandle, SaveResult, is_committed, save, save_async
from ._serving import restore_params
from ._storage import Location
from ._verify import VerifyResult, verify

__all__ = [
    "CheckpointCallback",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "Checkpointable",
    "CoordinationError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "LeafMetadata",
    "Location",
    "NotCommittedError",
    "Pending",
    "SaveHandle",
    "SaveResult",
    "StructureError",
    "UnknownItemError",
    "VerifyResult",
    "Written",
    "is_committed",
    "metadata",
    "restore",
    "restore_params",
    "save",
    "save_async",
    "verify",
]
