"""flax_orbax_plugin: fast, safe, sharded checkpointing for Flax/Optax training loops.

The core (one pytree):

    fop.save(path, tree)                 # durable and committed on return
    handle = fop.save_async(path, tree)  # returns after the host snapshot; handle.wait()
    tree = fop.restore(path, like=None)  # like: arrays / ShapeDtypeStructs / None -> numpy
    info = fop.metadata(path)            # leaves, shapes, dtypes, shardings; no data read
    report = fop.verify(path)            # every checksum of a checkpoint or a directory

A directory of training steps: ``CheckpointManager``, ``CheckpointCallback``;
serving: ``restore_params``.

Coming from elsewhere, going elsewhere:

    tree = fop.restore(orbax_dir, like)               # Orbax directories read as they are
    fop.import_orbax(orbax_dir, out_dir)              # ... or converted to steps
    fop.import_msgpack(flax_msgpack_file, out_dir)    # flax.serialization / training.checkpoints
    fop.to_safetensors(path_or_tree, out, max_shard_size="5GB")
    params = fop.from_safetensors(index_or_files, like)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _version
from ._base import interrupts as _interrupts

if TYPE_CHECKING:  # the names for type checkers; at run time __getattr__ loads them
    # (the same statements as _api.py; tests/cli/test_cli_startup.py checks they agree)
    from ._core.save import SaveHandle, SaveResult, is_committed, save, save_async
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
    from ._format.metadata import CheckpointMetadata, LeafMetadata
    from ._interop.hf_shards import HFShards
    from ._interop.importing import import_msgpack, import_orbax
    from ._interop.msgpack_reader import restore_msgpack
    from ._interop.orbax_reader import restore_orbax
    from ._interop.safetensors import from_safetensors, to_safetensors
    from ._like.surgery_ops import Fuse, Rename, Split, Stack, Transpose, Unstack
    from ._like.surgery_plan import PlanEntry, RestorePlan
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
    from ._manager.lanes import Lane, Lanes
    from ._manager.manager import CheckpointManager
    from ._manager.retention import KeepAny, KeepBest, KeepEvery, KeepFor, KeepLast, Retention
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
    from ._manager.tiers.tier_option import Tier
    from ._reading.restore import metadata, restore, restore_params
    from ._state.iterators import StepIndexedIterator
    from ._storage.location import Location
    from ._version import __version__ as __version__

__all__ = [
    "AllOf",
    "AnyOf",
    "AtSteps",
    "CheckpointCallback",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "Checkpointable",
    "Continuous",
    "CoordinationError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "Event",
    "EventHookError",
    "HookReentryError",
    "EverySeconds",
    "EverySteps",
    "ForeignEntryError",
    "Fuse",
    "HFShards",
    "InitialSave",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepFor",
    "KeepLast",
    "Lane",
    "Lanes",
    "LeafMetadata",
    "Location",
    "MetricWriterEvents",
    "NotCommittedError",
    "NothingMatchedError",
    "OnPreemption",
    "OptionError",
    "OptionTypeError",
    "Pending",
    "PlanEntry",
    "ProcessFailedError",
    "ReadRequest",
    "Rename",
    "ReplicationError",
    "RestoreDone",
    "RestorePlan",
    "Retention",
    "SaveBlockingDone",
    "SaveCancelledError",
    "SaveCommitted",
    "SaveFailed",
    "SaveHandle",
    "SavePolicy",
    "SaveRequest",
    "SaveResult",
    "SaveStarted",
    "Split",
    "Stack",
    "StepDeletedError",
    "StepIndexedIterator",
    "StepParts",
    "StepReplicated",
    "StepsRemoved",
    "StoreAccessError",
    "StructureError",
    "Tier",
    "TransformError",
    "Transpose",
    "UnknownItemError",
    "Unstack",
    "UnsupportedLocationError",
    "UnsupportedRuntimeError",
    "VerifyResult",
    "Written",
    "from_safetensors",
    "import_msgpack",
    "import_orbax",
    "is_committed",
    "metadata",
    "restore",
    "restore_msgpack",
    "restore_orbax",
    "restore_params",
    "save",
    "save_async",
    "to_safetensors",
    "verify",
]


# Names a serving process uses alone, loaded from their own module on first use (the
# statement _api.py has), without every wing: a serving process's first use of
# ``restore_params`` imported the whole API (0.1 s under load, half of it the interop
# and manager wings serving never touches). Any other name loads them all.
_OWN_MODULE = (("restore_params", "._reading.restore"),)


def __getattr__(name: str):
    """A public name, imported on its first use (PEP 562) with all the others (serving's
    ``restore_params`` alone: see ``_OWN_MODULE``)."""
    if name == "__version__":
        value = _version.__version__
    elif name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        # A Ctrl-C while the modules load (JAX's import, seconds) was raised inside
        # JAX's garbage-collection callback, which dropped it: the first save then ran
        # and committed. Held until they are loaded, then raised here, before any use.
        with _interrupts.deferred_sigint():
            value = _public(name)
    globals()[name] = value
    return value


def _public(name: str):
    own = dict(_OWN_MODULE).get(name)
    if own is not None:
        value = getattr(importlib.import_module(own, __name__), name)
    else:
        # Inside the function on purpose: ``_api`` imports JAX and tensorstore (seconds),
        # which ``import flax_orbax_plugin`` and the CLI's --help/--version must not pay.
        # Python's import lock makes a concurrent first use wait for the finished module.
        from . import _api

        value = getattr(_api, name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"__version__"})
