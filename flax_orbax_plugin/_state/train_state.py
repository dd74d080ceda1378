"""Split a training state into checkpointables and merge them back.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._state.train_state``.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Mapping
from typing import Any

import jax

from .._base.tree import encode_key, path_string
from .._errors import StructureError

__all__ = [
    "PLAIN_VALUE_TYPES",
    "holds_nnx_objects",
    "merge_state",
    "nnx_state_as_dict",
    "split_state",
    "update_in_place",
]

_NNX_MODULE_ITEMS = ("params", "rng", "model_state")
# Never NNX nor a TrainState: a dict of str names to these (or arrays) is its own items
PLAIN_VALUE_TYPES = frozenset({dict, list, tuple, int, float, bool, str, type(None)})
_NNX_GRAPH_KINDS = ("model_and_optimizer", "optimizer", "rngs", "module")
_ELEMENT_KINDS = (
    "an nnx.Module, nnx.Optimizer, nnx.ModelAndOptimizer, nnx.Rngs, nnx.State or a Linen TrainState"
)


def _nnx():
    """``flax.nnx`` if imported, else None (no NNX object can exist; flax is slow to import)."""
    return sys.modules.get("flax.nnx")


def _is_struct_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _pytree_fields(x: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(x) if f.metadata.get("pytree_node", True)]


def _nnx_kind(x: Any) -> str | None:
    nnx = _nnx()
    if nnx is None:
        return None
    mao = getattr(nnx, "ModelAndOptimizer", None)
    if mao is not None and isinstance(x, mao):
        return "model_and_optimizer"
    if isinstance(x, nnx.Optimizer):
        return "optimizer"
    if isinstance(x, nnx.Rngs):
        return "rngs"
    if isinstance(x, nnx.Module):
        return "module"
    if isinstance(x, nnx.State):
        return "state"
    return None


def _module_filters():
    nnx = _nnx()
    return (nnx.Param, nnx.RngState, ...)


def _split_module_parts(parts: Any) -> dict[str, Any]:
    nnx = _nnx()
    return {
        name: nnx.to_pure_dict(part)
        for name, part in zip(_NNX_MODULE_ITEMS, parts, strict=True)
        if len(part) > 0
    }


def _split_optimizer(x: Any) -> dict[str, Any]:
    nnx = _nnx()
    items = dict(nnx.to_pure_dict(nnx.state(x)))  # tx, wrt: attributes, never written
    items.pop("model", None)  # a ModelAndOptimizer's model: split as a module
    items.setdefault("opt_state", {})  # an optimizer without arrays (optax.sgd): an empty one
    return items


def _split_nnx(x: Any, kind: str) -> dict[str, Any]:
    nnx = _nnx()
    if kind == "optimizer":
        return _split_optimizer(x)
    if kind == "model_and_optimizer":
        items = _split_module_parts(nnx.state(x.model, *_module_filters()))
        items.update(_split_optimizer(x))
        return items
    if kind == "rngs":
        return {"rngs": nnx.to_pure_dict(nnx.state(x))}
    if kind == "module":
        return _split_module_parts(nnx.state(x, *_module_filters()))
    return _split_module_parts(nnx.filter_state(x, *_module_filters()))


def _merge_optimizer(like: Any, restored: Mapping[str, Any]) -> None:
    nnx = _nnx()
    state = nnx.state(like)
    pure = dict(nnx.to_pure_dict(state))
    updates = {k: v for k, v in restored.items() if k in pure and k != "model"}
    if not updates:
        return
    pure.update(updates)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(like, state)


def _merge_module_parts(parts: Any, restored: Mapping[str, Any]) -> Any:
    """``parts`` (params, rng, model_state), each given its restored item in place."""
    nnx = _nnx()
    for name, part in zip(_NNX_MODULE_ITEMS, parts, strict=True):
        if name in restored and len(part) > 0:
            nnx.replace_by_pure_dict(part, restored[name])
    return parts


def _merge_module(like: Any, restored: Mapping[str, Any]) -> None:
    nnx = _nnx()
    for part in _merge_module_parts(nnx.state(like, *_module_filters()), restored):
        if len(part) > 0:
            nnx.update(like, part)


def _merge_nnx(like: Any, kind: str, restored: Mapping[str, Any]) -> Any:
    nnx = _nnx()
    if kind == "optimizer":
        _merge_optimizer(like, restored)
    elif kind == "model_and_optimizer":
        _merge_module(like.model, restored)
        _merge_optimizer(like, restored)
    elif kind == "rngs":
        if "rngs" in restored:
            state = nnx.state(like)
            nnx.replace_by_pure_dict(state, restored["rngs"])
            nnx.update(like, state)
    elif kind == "module":
        _merge_module(like, restored)
    else:
        parts = _merge_module_parts(nnx.filter_state(like, *_module_filters()), restored)
        return nnx.merge_state(*parts)
    return like


def _split_parts(state: Mapping[str, Any] | list | tuple) -> dict[str, Any]:
    """The items of each part of a dict or tuple of parts, two providing one refused."""
    items: dict[str, Any] = {}
    owners: dict[str, str] = {}
    pairs = state.items() if isinstance(state, Mapping) else enumerate(state)
    for key, value in pairs:
        where = f"state[{key!r}]"
        if not isinstance(state, Mapping):
            if _nnx_kind(value) is None and not _is_struct_dataclass(value):
                raise TypeError(f"{where}: expected {_ELEMENT_KINDS}, found {type(value).__name__}")
            parts = split_state(value)
        elif not isinstance(key, str):
            raise TypeError(f"item names must be str, found {key!r}")
        else:
            kind = _nnx_kind(value)
            parts = _split_nnx(value, kind) if kind in _NNX_GRAPH_KINDS else {key: value}
        for name, part in parts.items():
            if name in items:
                raise TypeError(
                    f"{owners[name]} and {where} both provide item {name!r}; keep one of them "
                    "apart as a pytree item of its own, e.g. a dict "
                    "{'model': model, 'optimizer': optimizer, 'ema': nnx.state(ema_model)}"
                )
            items[name] = part
            owners[name] = where
    return items


def split_state(state: Any) -> dict[str, Any]:
    """``{item name: value}`` of a training state; TypeError for what cannot be split."""
    if state is None:
        return {}
    kind = _nnx_kind(state)
    if kind is not None:
        return _split_nnx(state, kind)
    if isinstance(state, Mapping):
        return _split_parts(state)
    if _is_struct_dataclass(state):
        return {name: getattr(state, name) for name in _pytree_fields(state)}
    if isinstance(state, list | tuple) and state:
        return _split_parts(state)
    raise TypeError(
        f"cannot split a {type(state).__name__} into checkpointables: expected {_ELEMENT_KINDS}"
        " (or another flax.struct dataclass), a tuple of those, or a dict {item name: value}"
    )


def _subset(restored: Mapping[str, Any], names: Any) -> dict[str, Any]:
    return {k: v for k, v in restored.items() if k in names}


def merge_state(like: Any, restored: Mapping[str, Any]) -> Any:
    """``restored`` items put back into a state like ``like`` (None: the dict of items)."""
    if like is None:
        return dict(restored)
    kind = _nnx_kind(like)
    if kind is not None:
        return _merge_nnx(like, kind, restored)
    if isinstance(like, Mapping):
        out = dict(like)
        nnx_names: set[str] = set()
        for key, value in like.items():
            if _nnx_kind(value) in _NNX_GRAPH_KINDS:
                names = set(_split_nnx(value, _nnx_kind(value)))
                nnx_names |= names
                out[key] = merge_state(value, _subset(restored, names))
        out.update({k: v for k, v in restored.items() if k not in nnx_names})  # None: as read
        return out
    if _is_struct_dataclass(like):
        updates = _subset(restored, set(_pytree_fields(like)))
        _check_none_in_like({k: getattr(like, k) for k in updates}, updates)
        if hasattr(like, "replace"):
            return like.replace(**updates)
        return dataclasses.replace(like, **updates)
    if isinstance(like, list | tuple) and like:
        split_state(like)  # validates every element, with its position
        merged = [merge_state(s, _subset(restored, set(split_state(s)))) for s in like]
        return type(like)(merged)
    raise TypeError(f"cannot merge checkpointables into a {type(like).__name__}")


def _check_none_in_like(like: Mapping[str, Any], restored: Mapping[str, Any]) -> None:
    """Refuses a field None in ``like`` where the step holds values (silently a dict)."""
    for name, value in restored.items():
        if name not in like or like[name] is not None:
            continue
        found = jax.tree_util.tree_leaves_with_path(value)
        paths = [path_string([encode_key(k) for k in keys]) for keys, _ in found]
        if paths:
            shown = ", ".join(paths[:3]) + (" ..." if len(paths) > 3 else "")
            raise StructureError(
                f"item {name!r}: the given state's field {name!r} is None, but the step "
                f"holds {len(paths)} value(s) there ({shown}); give the state a {name}, or "
                f"leave the item out: CheckpointCallback.on_train_start(state, reset="
                f"({name!r},)) or CheckpointManager.restore(like=state, items=[...])"
            )


def is_nnx(like: Any) -> bool:
    """Whether ``like`` is an NNX object, or a mapping that holds one."""
    return _nnx_kind(like) is not None or (isinstance(like, Mapping) and holds_nnx_objects(like))


def holds_nnx_objects(state: Mapping[str, Any]) -> bool:
    """Whether a mapping holds an NNX module, optimizer or Rngs (split, not stored as is)."""
    return any(_nnx_kind(v) in _NNX_GRAPH_KINDS for v in state.values())


def update_in_place(like: Any, restored: Any) -> Any:
    """``restored`` written into ``like``'s NNX objects (also nested), else ``restored``."""
    if _nnx_kind(like) in _NNX_GRAPH_KINDS:
        if type(restored) is not type(like):  # a RestorePlan (dry_run)
            return restored
        nnx = _nnx()
        nnx.update(like, nnx.state(restored))
        return like
    if isinstance(like, list | tuple) and type(restored) is type(like):
        if len(restored) != len(like):
            return restored
        elements = [update_in_place(a, b) for a, b in zip(like, restored, strict=True)]
        if all(map(operator.is_, like, elements)):
            return like
        return type(like)._make(elements) if hasattr(like, "_make") else type(like)(elements)
    if type(like) is dict and type(restored) is dict and restored.keys() == like.keys():
        return {k: update_in_place(like[k], restored[k]) for k in like}
    return restored


def nnx_state_as_dict(like: Any) -> tuple[Any, Any]:
    """``(pure dict, back)`` for an ``nnx.State`` (``back``: a new State), else ``(like, None)``."""
    if _nnx_kind(like) != "state":
        return like, None
    nnx = _nnx()

    def back(restored: Any) -> Any:
        out = jax.tree.map(lambda x: x, like)  # a new State, like's structure
        nnx.replace_by_pure_dict(out, restored)
        return out

    return nnx.to_pure_dict(like), back
