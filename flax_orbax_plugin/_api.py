"""The public names of ``flax_orbax_plugin``, imported eagerly (JAX, tensorstore: seconds);
loaded by the package's ``__init__`` on the first access of a public name (PEP 562)."""

# ruff: noqa: F401  (every import here is a re-export, through the package)

from ._base.keywords import named_keywords as _named_keywords
from ._core.save import SaveHandle, SaveResult, save
from ._core.save_async import is_committed, save_async
from ._core.verify import VerifyResult, verify
from ._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CoordinationError,
    CorruptCheckpointError,
    DirectoryLockedError,
    EventHookError,
    ForeignEntryError,
    HookReentryError,
    NotCommittedError,
    NothingMatchedError,
    OptionError,
    OptionTypeError,
    ProcessFailedError,
    ReplicationError,
    SaveCancelledError,
    StepDeletedError,
    StoreAccessError,
    StructureError,
    TransformError,
    UnknownItemError,
    UnsupportedLocationError,
    UnsupportedRuntimeError,
)
from ._format.layout import CheckpointMetadata, LeafMetadata
from ._interop.hf_shards import HFShards
from ._interop.importing import import_msgpack, import_orbax
from ._interop.msgpack_reader import restore_msgpack
from ._interop.orbax_reader import restore_orbax
from ._interop.safetensors import from_safetensors, to_safetensors
from ._like.surgery import Fuse, PlanEntry, Rename, RestorePlan, Split, Stack, Transpose, Unstack
from ._manager.callback import CheckpointCallback
from ._manager.checkpointables import Checkpointable, Pending, ReadRequest, SaveRequest, Written
from ._manager.events import (
    Event,
    MetricWriterEvents,
    RestoreDone,
    SaveBlockingDone,
    SaveCommitted,
    SaveFailed,
    SaveStarted,
    StepReplicated,
    StepsRemoved,
)
from ._manager.manager import CheckpointManager
from ._manager.retention import (
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepFor,
    KeepLast,
    Lane,
    Lanes,
    Retention,
)
from ._manager.save_rules import (
    AllOf,
    AnyOf,
    AtSteps,
    Continuous,
    EverySeconds,
    EverySteps,
    InitialSave,
    OnPreemption,
    SavePolicy,
)
from ._manager.step_parts import StepParts
from ._manager.tiers.tier import Tier
from ._reading.restore import metadata, restore, restore_params
from ._state.iterators import StepIndexedIterator
from ._storage.location import Location

# A misspelt keyword is named with the one meant ("did you mean keep=?") for each public
# function and the constructors of what users make; the records the library makes
# itself (locations, requests, results, events, metadata) are left as they are.
_MADE_INSIDE = {
    "CheckpointMetadata",
    "Checkpointable",
    "Event",
    "LeafMetadata",
    "Location",
    "Pending",
    "PlanEntry",
    "ReadRequest",
    "RestoreDone",
    "RestorePlan",
    "SaveBlockingDone",
    "SaveCommitted",
    "SaveFailed",
    "SaveHandle",
    "SaveRequest",
    "SaveResult",
    "SaveStarted",
    "StepParts",
    "StepReplicated",
    "StepsRemoved",
    "VerifyResult",
    "Written",
}
for _name in [n for n in globals() if not n.startswith("_") and n not in _MADE_INSIDE]:
    globals()[_name] = _named_keywords(globals()[_name])
