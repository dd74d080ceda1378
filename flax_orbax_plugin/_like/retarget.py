"""Retargeting a template: the same shapes with another float dtype or other shardings.

Used where a caller asks for a checkpoint's leaves in another form than they were
saved (``restore_params(..., dtype=, sharding=)``, native or Orbax). Pure: builds
``jax.ShapeDtypeStruct`` leaves, touches no device memory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


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
