"""Reading Orbax checkpoints without importing orbax: leaves, trees, params, steps. Each
claimed size is checked before anything is allocated; nothing here unpickles. Any thread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

import jax
import tensorstore as ts

from .._base import tree as _tree
from .._base.distributed import public
from .._base.env import flag
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StructureError,
)
from .._format.foreign import ITEM_METADATA, is_step
from .._format.steps import STEP_OR_NONE
from .._like import onto_like as _onto_like
from .._like import placing as _placing
from .._like.onto_like import legacy_cast, retarget
from .._storage.contexts import context
from .._storage.location import Location
from .._storage.store_errors import arguments, refusals
from .orbax_layout import (
    STRINGS_FILE,
    OrbaxItem,
    OrbaxLeaf,
    custom_metadata,
    open_orbax,
    read_json,
)
from .orbax_steps import list_steps

__all__ = ["lone_item", "orbax_steps", "read_step", "restore_orbax", "restore_orbax_params"]


_MAX_LEAF_BYTES = 1 << 40  # a leaf claiming more is malformed metadata, never allocated
CUSTOM_METADATA = "custom_metadata"  # the extras key import gives a step's custom_metadata
_ARRAY_LEAF = "checkpoint"  # the one leaf of an ArraySave item (and of a random key)


def orbax_steps(path: Any) -> list[int]:
    """Committed steps of an Orbax manager directory."""
    return list(list_steps(Location.from_path(path)).steps)


class ItemReader:
    """Opens the arrays of one item; one tensorstore context (and so one OCDBT cache)."""

    def __init__(self, item: OrbaxItem):
        self.item = item
        self.context = context(local=item.location.is_local)
        self._strings: dict[str, Any] | None = None

    def open(self, leaf: OrbaxLeaf) -> ts.TensorStore:
        loc = self.item.location
        if self.item.use_ocdbt:
            kvstore = {"driver": "ocdbt", "base": loc.kvstore(), "path": leaf.param_name + "/"}
        else:
            kvstore = loc.kvstore(leaf.param_name)
        spec = {"driver": "zarr3" if self.item.use_zarr3 else "zarr", "kvstore": kvstore}
        if self.item.all_chunks_stored:
            spec["fill_missing_data_reads"] = False
        try:
            return ts.open(spec, open=True, context=self.context).result()
        except ValueError as e:
            raise CorruptCheckpointError(
                f"leaf {leaf.path!r} in {self.item}: cannot open its array "
                f"{leaf.param_name!r} (value type {leaf.value_type!r}): {e}"
            ) from e

    def string(self, leaf: OrbaxLeaf) -> str:
        if self._strings is None:
            data = read_json(self.item.location, STRINGS_FILE)
            if not isinstance(data, dict):
                raise CorruptCheckpointError(f"{self.item}/{STRINGS_FILE}: expected an object")
            self._strings = data
        value = self._strings.get(leaf.param_name)
        if not isinstance(value, str):
            raise CorruptCheckpointError(
                f"leaf {leaf.path!r}: expected a string in {self.item}/{STRINGS_FILE}, "
                f"found {type(value).__name__}"
            )
        return value

    def read(
        self, leaf: OrbaxLeaf, like: Any, *, allow_cast: bool = False, rounds: bool = False
    ) -> Any:
        """One leaf in the form of ``like`` (``rounds``: a checked cast may round)."""
        if leaf.value_type in ("None", "Dict", "List", "string"):
            string = leaf.value_type == "string"
            empty = isinstance(like, (dict, list, tuple)) and len(like) == 0
            if like is not None and not (isinstance(like, str) if string else empty):
                what = "a string" if string else f"an empty {leaf.value_type}"
                raise StructureError(
                    f"leaf {leaf.path!r}: expected {_onto_like.describe(like)} (from like), "
                    f"found {what} in {self.item}"
                )
            return (
                self.string(leaf)
                if string
                else {"None": None, "Dict": {}, "List": []}[leaf.value_type]
            )
        store = self.open(leaf)
        shape = tuple(int(d) for d in store.shape)
        nbytes = math.prod(shape) * store.dtype.numpy_dtype.itemsize  # Python ints
        if nbytes > _MAX_LEAF_BYTES:
            raise CorruptCheckpointError(
                f"leaf {leaf.path!r} in {self.item}: its array metadata claims shape "
                f"{list(shape)} ({nbytes} bytes), more than the {_MAX_LEAF_BYTES}-byte limit"
            )
        plan = _placing.plan(
            leaf.path,
            store.shape,
            store.dtype.numpy_dtype,
            like,
            source=str(self.item),
            allow_cast=allow_cast,
            python_scalar=leaf.value_type == "scalar",
            rounds=rounds,
        )

        def read(index):
            try:
                return store[index].read().result()
            except ValueError as e:
                raise CorruptCheckpointError(
                    f"leaf {leaf.path!r} in {self.item}: stored data is damaged or missing ({e})"
                ) from e

        try:
            return _placing.materialize(plan, read)
        except MemoryError:
            raise CorruptCheckpointError(
                f"leaf {leaf.path!r} in {self.item}: its array metadata claims shape "
                f"{list(shape)} ({nbytes} bytes), more than this host can allocate"
            ) from None


def restore_item(
    item: OrbaxItem, like: Any, partial: bool, allow_cast: bool, *, rounds: bool = False
) -> Any:
    """One item's value: a JSON value, a text, or its tree in the form of ``like``."""
    if item.kind == "json":
        return read_json(item.location, item.file)
    if item.kind == "text":  # a proto, as text
        raw = item.location.read_bytes(item.file)
        if raw is None:
            raise CorruptCheckpointError(f"{item}/{item.file}: missing")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptCheckpointError(f"{item}/{item.file}: not UTF-8 text ({e})") from None
    where = f"item {item.name!r} of the Orbax checkpoint {item.location.parent}: {item.unreadable}"
    if item.kind == "missing":
        raise CorruptCheckpointError(f"{where}; restore the other items: like={{...}} naming them")
    if item.kind == "unreadable":
        raise CheckpointError(
            f"{where}; restore the other items (like={{...}} naming them) and this one with orbax"
        )
    if item.unwrap:  # one array saved alone: orbax names its only leaf 'checkpoint'
        if [leaf.path for leaf in item.leaves] != [_ARRAY_LEAF]:
            raise CorruptCheckpointError(
                f"{item}/{ITEM_METADATA}: an array item: expected the one leaf "
                f"{_ARRAY_LEAF!r}, found {[leaf.path for leaf in item.leaves][:5]}"
            )
        like = None if like is None else {_ARRAY_LEAF: like}
        return _restore_tree(item, like, allow_cast, rounds=rounds)[_ARRAY_LEAF]
    tree = _restore_tree(item, like, allow_cast, partial=partial, rounds=rounds)
    return tuple(tree) if item.as_tuple and isinstance(tree, list) else tree


def _restore_tree(
    item: OrbaxItem, like: Any, allow_cast: bool, *, partial: bool = False, rounds: bool = False
):
    """The tree of a pytree item in the form of ``like``, one leaf's data read at a time."""
    reader = ItemReader(item)
    if like is None:
        return _tree.rebuild(
            (list(leaf.keys), reader.read(leaf, None, allow_cast=allow_cast))
            for leaf in item.leaves
        )
    by_path = {leaf.path: leaf for leaf in item.leaves}
    flat, treedef = _tree.flatten(like)
    empty = ("None", "Dict", "List")
    data = [leaf.path for leaf in item.leaves if leaf.value_type not in empty]
    check_like_paths(flat, by_path, data, f"the Orbax checkpoint {item}", partial=partial)
    values = {
        p: reader.read(by_path[p], leaf_like, allow_cast=allow_cast, rounds=rounds)
        for p, _, leaf_like in flat
    }
    # a field-less node of like (optax's EmptyState) stays itself: Orbax saved it as None
    kept = [leaf if _tree.is_empty_node(leaf) else values[p] for p, _, leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, kept)


def check_like_paths(
    flat: list, stored: Collection[str], data: list[str], source: str, *, partial: bool
) -> None:
    """StructureError naming a leaf of ``like`` (``flat``) that ``stored`` lacks, or,
    without ``partial``, one of ``data`` that ``like`` lacks. Every foreign reader's."""
    wanted = {p for p, _, _ in flat}
    missing = sorted(wanted - set(stored))
    if missing:
        more = f" ({len(missing) - 1} more)" if len(missing) > 1 else ""
        raise StructureError(
            f"leaf {missing[0]!r}: expected by like, found no such key in {source}"
            f"{more}{_onto_like.near_miss(missing[0], stored)}"
        )
    unexpected = [p for p in data if p not in wanted]
    if unexpected and not partial:
        raise StructureError(
            f"leaf {unexpected[0]!r}: unexpected key: found in {source} but not in like; "
            f"pass partial=True to restore a subtree"
        )


def lone_item(loc: Location, items: dict[str, OrbaxItem]) -> OrbaxItem | None:
    """The one item ``loc`` is itself, of ``open_orbax(loc)``'s; None for a step of items."""
    if len(items) != 1:
        return None
    (item,) = items.values()
    at = item.location
    if str(at) == str(loc) or (not is_step(loc) and str(at.parent) == str(loc)):
        return item
    return None


@public(errors=refusals(arguments("path")))
def restore_orbax(
    path: Any,
    like: Any = None,
    *,
    step: int | None = None,
    partial: bool = False,
    cast: str = "safe",
    allow_cast: bool | None = None,
) -> Any:
    """Restores an Orbax checkpoint in the form of ``like`` (rules of ``fop.restore``).

    An item directory gives its tree; a step or manager directory (latest step, or
    ``step``) gives ``{item name: tree or JSON value}``, and ``like`` is then a
    dict of its items (JSON and text items may be left out; pytree items only with
    ``partial``), or, where the step holds one tree (Orbax's ``default`` item beside
    metadata), that tree's ``like`` (a TrainState): that tree is returned. Dtype
    changes must be lossless unless ``cast="unsafe"`` (``allow_cast=True``, deprecated).
    """
    step = STEP_OR_NONE.check(step)
    partial = flag("partial", partial)
    allow_cast = legacy_cast(cast, allow_cast, where="restore_orbax") == "unsafe"
    loc = Location.from_path(path)
    _, items = open_orbax(loc, step=step)
    item = lone_item(loc, items)
    if item is not None:
        return restore_item(item, like, partial, allow_cast)
    if like is None:
        return {name: restore_item(item, None, partial, allow_cast) for name, item in items.items()}
    trees = [n for n, item in items.items() if item.kind in ("pytree", "missing")]
    if not isinstance(like, Mapping):
        if len(trees) == 1:  # a TrainState for a step of one tree ('default') and metadata
            return restore_item(items[trees[0]], like, partial, allow_cast)
        raise StructureError(
            f"{loc} is an Orbax step with items {sorted(items)}: expected like to be a dict "
            f"of items, found {type(like).__name__}"
        )
    unknown = [k for k in like if k not in items]
    if unknown:
        hint = (
            f"; for the tree of item {trees[0]!r}: like={{{trees[0]!r}: ...}}"
            if len(trees) == 1
            else ""
        )
        raise StructureError(
            f"item {unknown[0]!r}: expected by like, found no such item in {loc} "
            f"(items: {sorted(items)}){hint}"
        )
    # JSON, text and unreadable items may be left out of like: they are not arrays
    extra = sorted(n for n, i in items.items() if n not in like and i.kind in ("pytree", "missing"))
    if not partial and extra:
        raise StructureError(
            f"item {extra[0]!r}: found in {loc} but not in like; pass partial=True"
        )
    return {k: restore_item(items[k], v, partial, allow_cast) for k, v in like.items()}


def _params_source(items: dict[str, OrbaxItem]) -> tuple[OrbaxItem, tuple[str, ...]]:
    """The item holding params and their key prefix in it (never one past a missing item)."""
    params = items.get("params")
    if params is not None and params.kind == "missing":
        raise CorruptCheckpointError(
            f"item 'params' of the Orbax checkpoint {params.location.parent}: {params.unreadable}"
        )
    if params is not None and params.kind == "pytree":
        return params, ()
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
    """The params of an Orbax checkpoint, reading nothing else (``fop.restore_params``'
    options): the ``params`` item, else a ``params`` subtree, else the only pytree."""
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


def read_step(step_loc: Location) -> tuple[dict[str, Any], dict[str, str]]:
    """``({item: tree or JSON value}, {item: kind})`` of one Orbax step, read to host."""
    _, items = open_orbax(step_loc)
    trees = {name: restore_item(item, None, False, False) for name, item in items.items()}
    kinds = {name: "pytree" if item.kind == "pytree" else "json" for name, item in items.items()}
    custom = custom_metadata(step_loc)
    if custom:
        if CUSTOM_METADATA in items:
            raise StructureError(
                f"{step_loc}: an item named {CUSTOM_METADATA!r} beside the step's own "
                f"custom_metadata; import one of them only"
            )
        trees[CUSTOM_METADATA], kinds[CUSTOM_METADATA] = custom, "json"
    return trees, kinds
