"""Retargeting a template: the same shapes with another float dtype or other shardings.

Used where a caller asks for a checkpoint's leaves in another form than they were
saved (``restore_params(..., dtype=, sharding=)``, native or Orbax). Pure: builds
``jax.ShapeDtypeStruct`` leaves (numpy templates for numpy leaves kept on the host),
touches no device memory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._base.tree import encode_key, path_string
from .._errors import OptionError, OptionTypeError, StructureError


def checked_dtype(dtype: Any) -> Any:
    """``dtype=`` (cast the floating leaves to it): None or a floating dtype, else an
    OptionError naming it (a cast of floats to integers truncates every value)."""
    if dtype is None:
        return None
    try:
        found = jnp.dtype(dtype)
    except TypeError:
        raise OptionTypeError(
            f"dtype: expected a floating dtype (e.g. jnp.bfloat16 or 'bfloat16'), found "
            f"{dtype!r:.60}"
        ) from None
    if not jnp.issubdtype(found, jnp.floating):
        raise OptionError(
            f"dtype: expected a floating dtype to cast the floating leaves to, found {found}"
        )
    return found


def retarget(tree: Any, dtype: Any, sharding: Any) -> Any:
    """ShapeDtypeStructs for ``tree`` with floating leaves cast to ``dtype`` and new shardings
    (one Sharding for every leaf, or a pytree of them); leaves without a shape pass, and
    a numpy leaf no sharding is given for stays a numpy template (read to the host)."""
    dtype = checked_dtype(dtype)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in with_paths]
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        shardings = [sharding] * len(leaves)
    else:
        try:
            shardings = treedef.flatten_up_to(sharding)
        except (TypeError, ValueError) as e:
            raise OptionTypeError(
                f"sharding: expected one jax Sharding, or a pytree of them of the params' "
                f"structure, found {type(sharding).__name__} {sharding!r:.60} ({e})"
            ) from None
        bad = [s for s in shardings if s is not None and not isinstance(s, jax.sharding.Sharding)]
        if bad:
            raise OptionTypeError(
                f"sharding: expected jax Shardings in the pytree, found {bad[0]!r:.60}"
            )
    out = []
    for (keypath, leaf), sh in zip(with_paths, shardings, strict=True):
        if not hasattr(leaf, "shape"):
            out.append(leaf)
            continue
        dt = leaf.dtype
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(dtype)
        if sh is None and isinstance(leaf, np.ndarray | np.generic):
            out.append(_on_host(leaf, dt))  # asked for on the host: stays numpy, its dtype
            continue
        if sh is None:
            sh = getattr(leaf, "sharding", None)
            if sh is not None and not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
                sh = None
        try:
            if isinstance(sh, jax.sharding.Sharding):
                sh.shard_shape(tuple(leaf.shape))  # one that cannot hold it: named here
            out.append(jax.ShapeDtypeStruct(leaf.shape, _on_device(dt), sharding=sh))
        except ValueError as e:  # jax's IndivisibleError: named here, with the leaf's shape
            path = path_string([encode_key(k) for k in keypath])
            raise StructureError(
                f"leaf {path!r}: sharding {sh} cannot hold its shape {tuple(leaf.shape)}: {e}"
            ) from None
    return jax.tree_util.tree_unflatten(treedef, out)


def _on_device(dtype: Any) -> Any:
    """The dtype a device array of ``dtype`` holds: int64 / float64 are int32 / float32
    unless jax_enable_x64 is on. Asked for as such, so the checked cast refuses a value
    the narrower dtype cannot hold (placing the wide data wrapped it silently)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype  # a PRNG key's dtype: its own
    return jax.dtypes.canonicalize_dtype(dtype)


def _on_host(leaf: np.ndarray | np.generic, dtype: Any) -> np.ndarray | np.generic:
    """A numpy leaf of a like with no sharding asked for it, as a numpy template of
    ``dtype``: the restore gives numpy of exactly that dtype (a ShapeDtypeStruct would
    give a device array, its int64 made int32 without jax_enable_x64). Allocates
    nothing: a broadcast of one value."""
    if leaf.dtype == dtype:
        return leaf
    if isinstance(leaf, np.generic):
        return np.zeros((), dtype)[()]
    return np.broadcast_to(np.zeros((), dtype), leaf.shape)


def concrete(tree: Any, *, option: str | None = None) -> Any:
    """``tree`` (a like, or a pytree of shardings) with every sharding on an
    ``AbstractMesh`` (``nnx.eval_shape`` under ``jax.set_mesh`` gives these) put on the
    concrete mesh of the ``jax.set_mesh`` around the call; a StructureError naming the
    leaf where there is none of that shape (an abstract mesh names no devices to read
    onto; ``option``: the option ``tree`` is, named instead). ``tree`` itself when it
    holds no abstract sharding (the common case)."""
    if not any(_abstract_mesh(leaf) for leaf in jax.tree_util.tree_leaves(tree)):
        return tree  # every restore asks: no key paths built for the common case
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for keypath, leaf in with_paths:
        if _abstract_mesh(leaf):
            path = path_string([encode_key(k) for k in keypath])
            where = f"leaf {path!r}" if option is None else f"{option} ({path})"
            leaf = _on_concrete(leaf, where.replace(" (<root>)", ""))
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def _sharding_of(leaf: Any) -> Any:
    return leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)


def _abstract_mesh(leaf: Any) -> bool:
    return isinstance(getattr(_sharding_of(leaf), "mesh", None), jax.sharding.AbstractMesh)


def _on_concrete(leaf: Any, where: str) -> Any:
    sharding = _sharding_of(leaf)
    mesh = jax.sharding.get_mesh()  # the concrete mesh of `with jax.set_mesh(...)`, if any
    if mesh.empty or mesh.shape_tuple != sharding.mesh.shape_tuple:
        raise StructureError(
            f"{where}: its sharding is on an abstract mesh {dict(sharding.mesh.shape)} "
            f"(nnx.eval_shape under jax.set_mesh gives these), which names no devices to "
            f"read onto: restore inside `with jax.set_mesh(mesh):` with that mesh, or give "
            f"NamedSharding(mesh, spec) on a concrete jax.sharding.Mesh"
        )
    placed = jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    if isinstance(leaf, jax.sharding.Sharding):
        return placed
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placed)
