"""Pytree paths: a tree flattened into named leaves and rebuilt from names; ``None`` and
empty nodes (``{}``, ``[]``, ``EmptyState()``) kept as leaves (jax drops them). Any thread.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .._errors import StructureError
from .key_paths import KeyEntry, path_string


@contextlib.contextmanager
def paused_gc():
    """Python's cyclic garbage collector paused (while thousands of records are built)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_PLAIN_LEAVES = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    np.ndarray,
    np.generic,
    jax.Array,
    jax.ShapeDtypeStruct,
)


def is_empty_node(x: Any) -> bool:
    """True for a pytree node without children (``{}``, ``[]``, ``()``, ``EmptyState()``)."""
    if isinstance(x, (dict, list, tuple)):
        return not x
    if x is None or isinstance(x, _PLAIN_LEAVES):
        return False
    leaves, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is None)
    return not leaves and not jax.tree_util.treedef_is_leaf(treedef)


_LEAF_TYPES: set[type] = set()  # exact types seen to be plain leaves (a cache)


def _is_leaf(x: Any) -> bool:
    if x is None:
        return True
    kind = type(x)
    if kind in _LEAF_TYPES:  # the common case, without isinstance checks
        return False
    if isinstance(x, _PLAIN_LEAVES):
        _LEAF_TYPES.add(kind)
        return False
    return is_empty_node(x)


def empty_kind(x: Any) -> str:
    """``empty_list`` for plain lists and tuples, ``empty_dict`` for the rest (as rebuilt)."""
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return "empty_list"
    return "empty_dict"


def empty_value(kind: str) -> Any:
    return [] if kind == "empty_list" else {}


def encode_key(entry: Any) -> KeyEntry:
    if isinstance(entry, jax.tree_util.DictKey):
        key = entry.key
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise TypeError(f"dict keys must be str or int to be saved, found {key!r}")
        return ("dict", key)
    if isinstance(entry, jax.tree_util.SequenceKey):
        return ("seq", entry.idx)
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return ("attr", entry.name)
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return ("flat", entry.key)
    raise TypeError(f"unsupported pytree key {entry!r}")


def flatten(tree: Any) -> tuple[list[tuple[str, list[KeyEntry], Any]], Any]:
    """``([(path, keys, leaf), ...], treedef)``."""
    try:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    except ValueError as e:  # jax cannot order a dict's keys: named here, by its path
        mixed = _mixed_keys(tree, [])
        if mixed is None:
            raise
        where, keys = mixed
        raise StructureError(
            f"dict at {where!r}: expected keys jax can order (all str or all int), found {keys}"
        ) from e
    out = []
    seen: set[str] = set()
    for keypath, leaf in flat:
        keys = []
        for k in keypath:
            try:
                keys.append(encode_key(k))
            except TypeError as e:
                raise StructureError(f"dict at {path_string(keys)!r}: {e}") from None
        path = path_string(keys)
        if path in seen:
            raise StructureError(f"two leaves share the path {path!r}")
        seen.add(path)
        out.append((path, keys, leaf))
    return out, treedef


def _mixed_keys(node: Any, keys: list[KeyEntry]) -> tuple[str, str] | None:
    """(path, its keys) of the first dict below ``node`` whose keys jax cannot sort."""
    if isinstance(node, dict):
        if len({type(k) for k in node}) > 1:
            shown = ", ".join(repr(k) for k in list(node)[:6])
            return path_string(keys) or "/", shown
        items = list(node.items())
    elif isinstance(node, (list, tuple)):
        items = list(enumerate(node))
    else:
        return None
    for key, child in items:
        found = _mixed_keys(child, [*keys, key if isinstance(key, str | int) else str(key)])
        if found is not None:
            return found
    return None


def rebuild(items: Iterator[tuple[list[KeyEntry], Any]]) -> Any:
    """Nested dicts and lists from ``(keys, value)`` pairs (restore without ``like``)."""
    root: list[Any] = [None]
    for keys, value in items:
        node, slot = root, 0
        for kind, key in keys:
            if node[slot] is None:
                node[slot] = [] if kind in ("seq", "flat") else {}
            container = node[slot]
            if isinstance(container, list):
                container.extend([None] * (key + 1 - len(container)))
            else:
                container.setdefault(key, None)
            node, slot = container, key
        node[slot] = value
    return root[0]
