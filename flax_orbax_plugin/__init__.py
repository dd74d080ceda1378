"""flax_orbax_plugin: fast, safe, sharded checkpointing for Flax/Optax training loops.

``fop.save`` / ``save_async`` / ``restore`` / ``metadata`` / ``verify`` for one pytree;
``CheckpointManager``, ``CheckpointCallback`` for a directory of steps; ``restore_params``
to serve; importers and safetensors export. Reference: docs/api.md.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._base import interrupts as _interrupts
from ._version import __version__ as __version__

if TYPE_CHECKING:  # the names for type checkers; at run time __getattr__ loads them
    from ._api import *  # noqa: F403  (_api.py: the one list of where each name lives)

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


# Names a serving process uses alone, loaded from their own module on first use without
# every wing (the interop and manager wings serving never touches).
_OWN_MODULE = {"restore_params": "._reading.restore"}


def __getattr__(name: str):
    """A public name, imported on its first use (PEP 562) with the others (but ``_OWN_MODULE``)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # A Ctrl-C while JAX imports (seconds) was dropped by its garbage-collection
    # callback: held until the modules are loaded, then raised here, before any use.
    with _interrupts.deferred_sigint():
        # Here on purpose: ``_api`` imports JAX and tensorstore (seconds), which
        # ``import flax_orbax_plugin`` and --help must not pay.
        module = importlib.import_module(_OWN_MODULE.get(name, "._api"), __name__)
        value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
