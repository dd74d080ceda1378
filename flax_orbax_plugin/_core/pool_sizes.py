"""The pooled host buffers one save takes, sized ahead (``BufferPool.reserve``).

Threading: any thread (pure: plans a stand-in tree, as the save would).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import tree as _tree
from .._format import layout as _layout
from .._format.layout import BatchStorage
from . import host_snapshot as _host_snapshot
from .formats import SaveRequest
from .plan import Plan


def pool_sizes(like: Any, request: SaveRequest) -> list[int]:
    """The pooled buffers' sizes of a save of ``like`` (arrays, or one device's structs)."""

    def stand_in(path, x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        sharding = getattr(x, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1:
            raise ValueError(
                f"reserve: leaf {jax.tree_util.keystr(path)!r}: expected an array or a "
                f"ShapeDtypeStruct on one device, found one sharded over "
                f"{len(sharding.device_set)} devices (pass the state itself)"
            )
        return np.broadcast_to(np.zeros((), x.dtype), x.shape)  # no memory: stride 0

    tree = jax.tree_util.tree_map_with_path(stand_in, like)
    with _tree.paused_gc():
        plan = Plan.build(tree, request)
    # a buffer per batch this process writes, and per region of a host leaf's own array
    leaves, batches, own_copy = plan.leaves, plan.batches, request.own_copy
    me = _distributed.process_index()
    writers = _host_snapshot.batch_writers(leaves, batches, me, own_copy)
    sizes = [
        b.size * _layout.dtype_from_name(b.dtype).itemsize
        for n, b in batches.items()
        if writers[n] == me
    ]
    for leaf, source, rows in _host_snapshot.owned_regions(leaves, writers, me, own_copy):
        if isinstance(leaf.record.storage, BatchStorage):
            continue
        data = source[0] if isinstance(source, tuple) else source
        if _host_snapshot.on_device(data):
            continue
        extents = [len(range(*r.indices(n))) for r, n in zip(rows, leaf.record.shape, strict=True)]
        sizes.append(math.prod(extents) * np.dtype(data.dtype).itemsize)
    return sizes
