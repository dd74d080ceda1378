"""The params of an Orbax checkpoint for serving, read alone:
:func:`restore_orbax_params` (``fop.restore_params`` on an Orbax directory).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .._base import tree as _tree
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .._like import onto_like as _onto_like
from .._like.onto_like import retarget
from .orbax_layout import OrbaxItem, OrbaxLeaf, open_orbax
from .orbax_reader import ItemReader, restore_item

__all__ = ["restore_orbax_params"]


def _params_source(items: dict[str, OrbaxItem]) -> tuple[OrbaxItem, tuple[str, ...]]:
    """The item holding params and their key prefix in it. A missing item is never
    passed over for another (that would serve the optimizer state)."""
    if "params" in items and items["params"].kind in ("pytree", "missing"):
        return _readable(items["params"]), ()
    pytrees = {n: i for n, i in items.items() if i.kind == "pytree"}
    where = next(iter(items.values())).location.parent if items else ""
    holders = {n: i for n, i in pytrees.items() if any(_top(leaf) == "params" for leaf in i.leaves)}
    if len(holders) > 1:
        # as the import splits them: a training state gives the params, not an EMA copy
        states = [n for n, i in holders.items() if any(_top(x) != "params" for x in i.leaves)]
        if len(states) != 1:
            raise CheckpointError(
                f"the Orbax checkpoint {where} holds params in several items "
                f"({', '.join(sorted(holders))}): which to serve is not clear; read the one "
                f"you mean, e.g. fop.restore('{where}/{sorted(holders)[0]}')['params']"
            )
        return holders[states[0]], ("params",)
    if holders:
        return next(iter(holders.values())), ("params",)
    missing = sorted(n for n, i in items.items() if i.kind == "missing")
    if missing:
        raise CorruptCheckpointError(
            f"no params in the Orbax checkpoint {where}: no item named 'params' and no item "
            f"with a top-level 'params' key, and item(s) {missing} are missing: "
            f"{items[missing[0]].unreadable}"
        )
    if len(pytrees) == 1:
        return next(iter(pytrees.values())), ()
    raise CheckpointNotFoundError(
        f"no params in the Orbax checkpoint {where}: "
        f"no item named 'params' and no item with a top-level 'params' key "
        f"(items: {sorted(items)})"
    )


def _readable(item: OrbaxItem) -> OrbaxItem:
    if item.kind == "missing":
        raise CorruptCheckpointError(
            f"item {item.name!r} of the Orbax checkpoint {item.location.parent}: {item.unreadable}"
        )
    return item


def _top(leaf: OrbaxLeaf) -> str | None:
    return leaf.keys[0][1] if leaf.keys and leaf.keys[0][0] == "dict" else None


def restore_orbax_params(
    path: Any,
    like: Any = None,
    *,
    step: int | None = None,
    dtype: Any = None,
    sharding: Any = None,
    partial: bool = False,
    cast: str = "safe",
) -> Any:
    """The params of an Orbax checkpoint, reading nothing else: the ``params`` item,
    else the ``params`` subtree of a pytree item, else the only pytree item. The
    options are ``fop.restore_params``'s."""
    _onto_like.check_policy(cast)
    _, items = open_orbax(path, step=step)
    item, prefix = _params_source(items)
    if prefix:
        leaves = tuple(
            dataclasses.replace(
                leaf, keys=leaf.keys[1:], path=_tree.path_string(list(leaf.keys[1:]))
            )
            for leaf in item.leaves
            if leaf.keys[0] == ("dict", prefix[0]) and len(leaf.keys) > 1
        )
        item = dataclasses.replace(item, leaves=leaves)
    if like is None and dtype is None and sharding is None:
        return restore_item(item, None, False, False)
    if like is None:
        reader = ItemReader(item)
        like = _tree.rebuild((list(leaf.keys), _abstract(reader, leaf)) for leaf in item.leaves)
    if dtype is not None or sharding is not None:
        like = retarget(like, dtype, sharding)
    return restore_item(item, like, partial, cast == "unsafe", rounds=dtype is not None)


def _abstract(reader: ItemReader, leaf: OrbaxLeaf) -> Any:
    if leaf.value_type in ("None", "Dict", "List", "string"):
        return reader.read(leaf, None)
    store = reader.open(leaf)
    return jax.ShapeDtypeStruct(tuple(store.shape), store.dtype.numpy_dtype)
