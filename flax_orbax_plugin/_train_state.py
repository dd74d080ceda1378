"""Split a training state into checkpointables and merge them back.

:func:`split_state` turns a training state into ``{item name: value}`` without
the user listing fields; :func:`merge_state` puts restored items back into a
``like`` of the same kind. Supported states:

* Flax Linen ``TrainState`` and any ``flax.struct`` dataclass (subclasses with
  extra pytree fields such as ``batch_stats`` or ``ema_params`` included): every
  pytree field becomes an item named after the field (``step``, ``params``,
  ``opt_state``, ``batch_stats`` ...). Static fields (``apply_fn``, ``tx``, any
  ``pytree_node=False`` field) are never written; on restore they come from
  ``like`` unchanged.
* Flax NNX: an ``nnx.Module`` (items ``params`` for ``nnx.Param`` variables,
  ``rng`` for RNG state, ``model_state`` for every other variable, e.g. batch
  statistics), an ``nnx.Optimizer`` (items ``step`` and ``opt_state``), an
  ``nnx.State`` such as ``nnx.state(model)`` (split like a module), or a tuple or
  list of these, e.g. ``(model, optimizer)``. Values are written as pure dicts.
  Merging updates a module or optimizer ``like`` in place (as ``nnx.update`` does)
  and returns it; an ``nnx.State`` like gets a new State.
* A mapping ``{item name: value}``: its keys are the item names.

Both functions are pure, cheap, and safe to call on abstract states built with
``jax.eval_shape`` / ``nnx.eval_shape``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["split_state", "merge_state"]

_NNX_MODULE_ITEMS = ("params", "rng", "model_state")


def _nnx():
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return None
    return nnx


def _is_struct_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _pytree_fields(x: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(x) if f.metadata.get("pytree_node", True)]


def _nnx_kind(x: Any) -> str | None:
    nnx = _nnx()
    if nnx is None:
        return None
    if isinstance(x, nnx.Optimizer):
        return "optimizer"
    if isinstance(x, nnx.Module):
        return "module"
    if isinstance(x, nnx.State):
        return "state"
    return None


def _module_filters():
    nnx = _nnx()
    return (nnx.Param, nnx.RngState, ...)


def _split_nnx(x: Any, kind: str) -> dict[str, Any]:
    nnx = _nnx()
    if kind == "optimizer":
        # Static parts (tx, wrt) are attributes, not state: never written.
        return dict(nnx.to_pure_dict(nnx.state(x)))
    if kind == "module":
        parts = nnx.state(x, *_module_filters())
    else:
        parts = nnx.filter_state(x, *_module_filters())
    return {
        name: nnx.to_pure_dict(part)
        for name, part in zip(_NNX_MODULE_ITEMS, parts, strict=True)
        if len(part) > 0
    }


def _merge_nnx(like: Any, kind: str, restored: Mapping[str, Any]) -> Any:
    nnx = _nnx()
    if kind == "optimizer":
        state = nnx.state(like)
        pure = dict(nnx.to_pure_dict(state))
        pure.update({k: v for k, v in restored.items() if k in pure})
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(like, state)
        return like
    if kind == "module":
        parts = nnx.state(like, *_module_filters())
    else:
        parts = nnx.filter_state(like, *_module_filters())
    new_parts = []
    for name, part in zip(_NNX_MODULE_ITEMS, parts, strict=True):
        if name in restored and len(part) > 0:
            nnx.replace_by_pure_dict(part, restored[name])
        new_parts.append(part)
    if kind == "module":
        for part in new_parts:
            if len(part) > 0:
                nnx.update(like, part)
        return like
    return nnx.merge_state(*new_parts)


def split_state(state: Any) -> dict[str, Any]:
    """Return ``{item name: value}`` for a training state (see the module docstring).

    Raises TypeError for a state of an unsupported kind, or for NNX objects in a
    tuple whose item names collide.
    """
    if state is None:
        return {}
    kind = _nnx_kind(state)
    if kind is not None:
        return _split_nnx(state, kind)
    if isinstance(state, Mapping):
        for k in state:
            if not isinstance(k, str):
                raise TypeError(f"item names must be str, found {k!r}")
        return dict(state)
    if _is_struct_dataclass(state):
        return {name: getattr(state, name) for name in _pytree_fields(state)}
    if isinstance(state, list | tuple) and state and all(_nnx_kind(s) for s in state):
        items: dict[str, Any] = {}
        for s in state:
            for name, value in split_state(s).items():
                if name in items:
                    raise TypeError(
                        f"two NNX objects in the state both provide item {name!r}; "
                        "pass them as a dict of items instead"
                    )
                items[name] = value
        return items
    raise TypeError(
        f"cannot split a {type(state).__name__} into checkpointables: expected a Flax "
        "TrainState (or other flax.struct dataclass), an nnx.Module, nnx.Optimizer, "
        "nnx.State, a tuple of those, or a dict {item name: value}"
    )


def merge_state(like: Any, restored: Mapping[str, Any]) -> Any:
    """Put ``restored`` items back into a state shaped like ``like``.

    Items of ``like`` missing from ``restored`` keep ``like``'s value, so a partial
    restore (``items=("params",)``) into a concrete ``like`` keeps the rest. With
    ``like=None`` the dict of items is returned.
    """
    if like is None:
        return dict(restored)
    kind = _nnx_kind(like)
    if kind is not None:
        return _merge_nnx(like, kind, restored)
    if isinstance(like, Mapping):
        out = dict(like)
        out.update(restored)
        return out
    if _is_struct_dataclass(like):
        fields = set(_pytree_fields(like))
        updates = {k: v for k, v in restored.items() if k in fields}
        if hasattr(like, "replace"):
            return like.replace(**updates)
        return dataclasses.replace(like, **updates)
    if isinstance(like, list | tuple) and like and all(_nnx_kind(s) for s in like):
        merged = []
        for s in like:
            names = set(split_state(s))
            merged.append(merge_state(s, {k: v for k, v in restored.items() if k in names}))
        return type(like)(merged)
    raise TypeError(f"cannot merge checkpointables into a {type(like).__name__}")
