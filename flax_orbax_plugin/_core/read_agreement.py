"""The processes of a collective read agree on what they read, before any byte.

Threading: the caller's thread, the same call on every process (inside the collective).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.read_agreement``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import tree as _tree
from .._errors import CoordinationError
from .._format import layout as _layout
from .._storage.location import Location
from .reads import ReadRequest

__all__ = ["agree_on_read"]

_SHOWN_LEAVES = 4000  # leaves named in the second round (a digest beyond them)


def agree_on_read(location: Location, like: Any, request: ReadRequest) -> None:
    """CoordinationError on every process unless all read the same path, options and like."""
    flat = [] if like is None else _tree.flatten(like)[0]
    leaves = [f"{path} {_describe(leaf)}" for path, _, leaf in flat]
    mine = {
        "checkpoint": str(location),
        "options": f"cast={request.cast!r}, {request.changes.describe()}",
        "like": _layout.sha256("\n".join(leaves).encode()),
    }
    views = request.region.gather_json("read-agreement", mine)
    for field in ("checkpoint", "options", "like"):
        values = [v[field] for v in views]
        if len(set(values)) == 1:
            continue
        if field == "like":
            raise CoordinationError(_like_difference(leaves, request.region))
        each = "; ".join(f"{v!r} on process {p}" for p, v in enumerate(values))
        raise CoordinationError(
            f"the processes of one collective restore read different {field}s ({each}): "
            f"every process must pass the same path, step and options"
        )


def _describe(leaf: Any) -> str:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return type(leaf).__name__  # a Python scalar, a string, None: no array to place
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        placed = f"{dict(sharding.mesh.shape)} {sharding.spec}"
    else:  # a host array, or one device's (a process's own): not compared across
        placed = "host" if isinstance(leaf, np.ndarray) else "local"
    return f"{list(shape)} {dtype} {placed}"


def _like_difference(leaves: list[str], region: _distributed.Region) -> str:
    """The message for likes that differ (a second round: every process names its leaves)."""
    views = region.gather_json("read-agreement-leaves", leaves[:_SHOWN_LEAVES])
    first = views[0]
    for p, other in enumerate(views[1:], start=1):
        for a, b in zip(first, other, strict=False):
            if a != b:
                return (
                    f"the processes of one collective restore passed different likes: the "
                    f"first leaf that differs is {a!r} on process 0 and {b!r} on process "
                    f"{p}; every process must pass the same tree, shapes, dtypes and "
                    f"shardings (jax.eval_shape of one state, one mesh)"
                )
        if len(first) != len(other):
            return (
                f"the processes of one collective restore passed different likes: "
                f"{len(first)} leaves on process 0, {len(other)} on process {p}"
            )
    return (
        f"the processes of one collective restore passed different likes (past their "
        f"first {_SHOWN_LEAVES} leaves)"
    )
