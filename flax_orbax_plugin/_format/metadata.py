"""Public descriptions of a checkpoint's leaves (:func:`flax_orbax_plugin.metadata`): the
frozen result types users see, made from the on-disk records of ``layout``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .layout import CheckpointDocument


@dataclasses.dataclass(frozen=True)
class LeafMetadata:
    """What is known about one saved leaf without reading its data."""

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str | None
    sharding: dict[str, Any] | None
    nbytes: int


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """Result of :func:`flax_orbax_plugin.metadata`: the leaves of a checkpoint.

    ``kind``: ``"pytree"``, or the kind of a step's item that holds a JSON value
    (``"json"``, ``"step"``, ``"data_iterator"``): no leaves, ``fop.restore`` returns
    the value (``format_version`` is then the step manifest's)."""

    path: str
    format_version: int
    created_at: float
    process_count: int
    leaves: dict[str, LeafMetadata]
    kind: str = "pytree"

    @property
    def total_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values())


def to_public(doc: CheckpointDocument, path: str) -> CheckpointMetadata:
    leaves = {
        r.path: LeafMetadata(r.path, r.kind, r.shape, r.dtype, r.sharding, r.nbytes)
        for r in doc.leaves
    }
    return CheckpointMetadata(path, doc.format_version, doc.created_at, doc.process_count, leaves)
