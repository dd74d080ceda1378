"""A step's items that are not pytrees (``step``, ``extras``, ``data_iterator``, any JSON
item), pointed at on their own: ``fop.restore(DIR/<step>/extras)`` returns the JSON
value, ``fop.metadata`` describes the item, and the CLI lists, inspects and verifies it.

They hold no ``_METADATA.json`` (that is a pytree's): the reading fronts call these
functions where ``_format.steps.classify`` found such an item (its step's manifest
read once, carried in the ``StepItem``), never the native reader. Each item is read by
the built-in checkpointable of its kind, exactly as ``CheckpointManager.restore``
reads it, its JSON checked against the checksum in the step manifest. Safe from any
thread.
"""

from __future__ import annotations

from typing import Any

from .._errors import CheckpointError
from .._format import metadata as _metadata
from .._format.layout import STEP_VERSION
from .._format.steps import StepItem, step_item
from .._interop import hf_shards as _hf_shards
from .._manager.checkpointables import BUILTIN_CHECKPOINTABLES

__all__ = ["StepItem", "describe", "read", "step_item"]

# The readers of the kinds that are not pytrees, by the kind the manifest records.
_READERS = {c.kind: c for c in BUILTIN_CHECKPOINTABLES.values() if c.kind != "pytree"}
_READERS[_hf_shards.KIND] = _hf_shards.HFShards(every_steps=1)  # {tensor name: array}


def read(item: StepItem, like: Any = None, *, changes: dict[str, Any] | None = None) -> Any:
    """The value of a non-pytree item, read as the manager reads it (``like``: an int
    or scalar template for ``step``, an iterator to set the state of for
    ``data_iterator``). ``changes`` (partial, missing, transform) apply to pytrees
    only: given for a JSON item, they are refused rather than silently ignored."""
    reader = _reader(item)
    asked = {k: v for k, v in (changes or {}).items() if v not in (None, False, "error")}
    if asked:
        raise CheckpointError(
            f"{item.location} is {item.label}, a JSON value: {', '.join(sorted(asked))}= apply "
            f"to pytrees (restore it without them)"
        )
    return reader.restore(item.location, like)


def describe(item: StepItem) -> _metadata.CheckpointMetadata:
    """``fop.metadata`` of a non-pytree item: its kind, the step's time and process
    count, and no leaves (reads nothing but the step manifest)."""
    _reader(item)
    return _metadata.CheckpointMetadata(
        path=str(item.location),
        format_version=STEP_VERSION,
        created_at=item.manifest.time,
        process_count=item.manifest.process_count,
        leaves={},
        kind=item.entry.kind,
    )


def _reader(item: StepItem) -> Any:
    reader = _READERS.get(item.entry.kind)
    if reader is None:
        raise CheckpointError(
            f"{item.location} is {item.label}, written by a checkpointable of your own: "
            f"read it with CheckpointManager(..., checkpointables={{{item.name!r}: ...}})"
            f".restore(items=({item.name!r},))"
        )
    return reader
