"""Serving: restore the params of a step alone, onto any device layout.

Opens nothing of a step but its manifest and ``params/`` (listing the directory and
checking which steps hold a manifest). Safe to call from any thread and any process,
even while a manager writes to the directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from . import _casting, _restore, _steps, _transform
from ._errors import CheckpointError, CheckpointNotFoundError
from ._storage import Location
from ._train_state import split_state

__all__ = ["restore_params"]


def _params_like(like: Any) -> Any:
    from flax_orbax_plugin._train_state import holds_nnx_objects

    if like is None or (isinstance(like, Mapping) and not holds_nnx_objects(like)):
        return like
    try:
        items = split_state(like)
    except TypeError:
        return like  # a params pytree of another kind (list, tuple, dataclass leaf tree)
    if "params" not in items:
        raise TypeError(f"like of type {type(like).__name__} has no params")
    return items["params"]


def retarget(tree: Any, dtype: Any, sharding: Any) -> Any:
    """ShapeDtypeStructs for ``tree`` with floating leaves cast to ``dtype`` and new shardings
    (one Sharding for every leaf, or a pytree of them); leaves without a shape pass."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        shardings = [sharding] * len(leaves)
    else:
        shardings = treedef.flatten_up_to(sharding)
    out = []
    for leaf, sh in zip(leaves, shardings, strict=True):
        if not hasattr(leaf, "shape"):
            out.append(leaf)
            continue
        dt = leaf.dtype
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(dtype)
        if sh is None:
            sh = getattr(leaf, "sharding", None)
            if sh is not None and not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
                sh = None
        out.append(jax.ShapeDtypeStruct(leaf.shape, dt, sharding=sh))
    return jax.tree_util.tree_unflatten(treedef, out)


def restore_params(
    directory: Any,
    like: Any = None,
    *,
    step: int | None = None,
    dtype: Any = None,
    sharding: Any = None,
    partial: bool = False,
    missing: str = "error",
    transform: Any = None,
) -> Any:
    """Restore only the params of a step (the latest by default), for serving.

    Opens nothing but ``<directory>/<step>/params/`` (listing the directory and
    checking each step's manifest exists). ``like`` is a params pytree (arrays or
    ShapeDtypeStructs, e.g. from ``jax.eval_shape``), a TrainState / NNX module
    whose params are taken, or None (numpy on the host). ``dtype`` casts the
    floating-point leaves; ``sharding`` is one Sharding for every leaf or a pytree
    of them. Safe to call from any thread, even while a manager writes.

    ``partial``, ``missing`` and ``transform`` restore into changed params, as
    ``fop.restore`` does (paths are within params: ``Dense_0/kernel``); e.g.
    ``partial=True`` with ``like`` a subset of the saved params.
    """
    changes = _transform.changes(partial=partial, missing=missing, transform=transform)
    loc = Location.from_path(directory)
    steps = _steps.committed_steps(loc)
    if not steps:  # none of ours: an Orbax directory is read directly (issue 16)
        from . import _orbax_import

        if _orbax_import.is_orbax_checkpoint(directory):
            if changes.keep_missing or changes.transform is not None or partial:
                raise CheckpointError(
                    f"{directory} is an Orbax checkpoint: partial=, missing= and transform= "
                    f"apply to this library's checkpoints; convert it first with "
                    f"fop.import_orbax(src, dst)"
                )
            return _orbax_import.restore_orbax_params(
                directory, _params_like(like), step=step, dtype=dtype, sharding=sharding
            )
    step = _steps.choose_step(loc, steps, step)
    step_loc = _steps.step_location(loc, step)
    entry = _steps.read_manifest(step_loc).items.get("params")
    if entry is None:
        raise CheckpointNotFoundError(f"step {step} of {loc} holds no params item")
    params_loc = step_loc.child(entry.dir)
    target = _params_like(like)
    if target is None and (dtype is not None or sharding is not None):
        host = _restore.restore(params_loc, None, **changes.kwargs())
        target = retarget(host, dtype, sharding)
        _casting.check_tree(host, target)  # float narrowing rounds; overflow to inf raises
        return jax.tree_util.tree_map(
            lambda x, t: (
                jax.device_put(x.astype(t.dtype), t.sharding)
                if t.sharding is not None
                else x.astype(t.dtype)
            ),
            host,
            target,
        )
    if target is not None and (dtype is not None or sharding is not None):
        target = retarget(target, dtype, sharding)
    return _restore.restore(params_loc, target, **changes.kwargs())
