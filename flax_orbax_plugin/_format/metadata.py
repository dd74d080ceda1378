"""Public descriptions of a checkpoint's leaves (:func:`flax_orbax_plugin.metadata`).

The on-disk records themselves live in ``_layout``; this module turns them into the
frozen result types users see, and describes jax shardings as JSON.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from .layout import CheckpointDocument


def describe_sharding(sharding: Any) -> dict[str, Any] | None:
    """A JSON description of a jax sharding (informational; restore uses ``like``)."""
    if sharding is None:
        return None
    return _describe_sharding(sharding)


@functools.lru_cache(maxsize=1024)
def _describe_sharding(sharding: Any) -> dict[str, Any]:
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = []
        for entry in sharding.spec:
            if entry is None or isinstance(entry, str):
                spec.append(entry)
            else:
                spec.append(list(entry))
        return {
            "type": "NamedSharding",
            "mesh_axis_names": list(sharding.mesh.axis_names),
            "mesh_shape": [int(s) for s in sharding.mesh.devices.shape],
            "spec": spec,
        }
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return {"type": "SingleDeviceSharding"}
    return {
        "type": type(sharding).__name__,
        "fully_replicated": bool(sharding.is_fully_replicated),
        "num_devices": len(sharding.device_set),
    }


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
        rec.path: LeafMetadata(
            path=rec.path,
            kind=rec.kind,
            shape=rec.shape,
            dtype=rec.dtype,
            sharding=rec.sharding,
            nbytes=rec.nbytes,
        )
        for rec in doc.leaves
    }
    return CheckpointMetadata(
        path=path,
        format_version=doc.format_version,
        created_at=doc.created_at,
        process_count=doc.process_count,
        leaves=leaves,
    )
