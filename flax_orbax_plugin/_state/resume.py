"""Resuming part of a training state: keep some items fresh, restore the rest.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._state.resume``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._base import tree as _tree
from .._base.shown import outside_stacklevel
from .._errors import NothingMatchedError, OptionError, OptionTypeError, StructureError
from .._format.steps import read_document
from .._like.onto_like import HINT
from .train_state import split_state

__all__ = ["check_items", "check_reset", "items_to_restore", "item_mismatch"]

_WHY = {"opt_state": "a new optimizer", "params": "a new model", "rng": "new random keys"}


def check_reset(reset: Any) -> tuple[str, ...]:
    """``reset=`` checked where it enters: a collection of item names (None: ())."""
    if isinstance(reset, str):
        raise OptionTypeError(
            f"reset must be a tuple of item names, e.g. ({reset!r},), found {reset!r}"
        )
    return () if reset is None else _names(reset, "reset", "e.g. ('opt_state',)")


def check_items(items: Any) -> tuple[str, ...] | None:
    """``items=`` checked where it enters: None, one item name, or a collection of them."""
    if items is None or isinstance(items, str):
        return items if items is None else (items,)
    names = _names(items, "items", "e.g. 'params' or ('params', 'extras')")
    if not names:  # it restored {} without a word
        raise OptionError("items names no item: found an empty collection; name one or more")
    return names


def _names(value: Any, option: str, example: str) -> tuple[str, ...]:
    if not isinstance(value, Iterable) or isinstance(value, bytes | bytearray):
        raise OptionTypeError(
            f"{option} must be a tuple of item names ({example}), found "
            f"{type(value).__name__} {value!r:.60}"
        )
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise OptionTypeError(
                f"{option}: every entry is an item name (a str), found "
                f"{type(name).__name__} {name!r:.60}"
            )
    return names


def items_to_restore(state: Any, *, reset: Iterable[str]) -> list[str]:
    """The item names of ``state`` less ``reset``; ValueError naming one it lacks."""
    reset = list(check_reset(reset))
    names = list(split_state(state))
    # "data_iterator" is no item of the state: resetting it starts the data afresh
    unknown = [n for n in reset if n not in names and n != "data_iterator"]
    if unknown:
        raise ValueError(
            f"reset names item {unknown[0]!r}, which the state does not have; its items: {names}"
        )
    return [n for n in names if n not in reset]


def item_mismatch(
    error: StructureError, *, name: str, step: int, location: Any, others: Any = None
) -> StructureError:
    """The core's StructureError for item ``name``, with how to start it (and ``others``) fresh."""
    detail = str(error).removesuffix("; pass partial=True to restore a subtree")
    detail = detail.removesuffix("\n" + HINT)
    names = [name, *misfits(others or {}, but=name)]
    reset = repr(tuple(names))  # ('params',) for one
    shown = " and ".join(repr(n) for n in names)
    but = f"every item but {shown}"
    if isinstance(error, NothingMatchedError):
        return NothingMatchedError(
            f"item {name!r} of step {step} in {location}: {detail}. To start {shown} "
            f"fresh on purpose instead: CheckpointCallback.on_train_start(state, "
            f"reset={reset}), or CheckpointManager.restore(like=state, items=[...{but}])"
        )
    also = ""
    if len(names) > 1:
        rest = ", ".join(repr(n) for n in names[1:])
        also = f"\n{rest} do{'es' if len(names) == 2 else ''} not fit either (saved shapes)"
    why = "; ".join(dict.fromkeys(_WHY.get(n, "a new structure") for n in names))
    if {"params", "opt_state"} <= set(names):  # the optimizer state mirrors the params
        why = why.replace("; a new optimizer", ", and the optimizer state that mirrors its params")
    return StructureError(
        f"item {name!r} of step {step} in {location} does not fit the given state: "
        f"{detail}{also}\nIf {'they' if len(names) > 1 else 'it'} changed on purpose "
        f"({why}), keep the given state's {shown} and restore the rest: "
        f"CheckpointCallback.on_train_start(state, reset={reset}), or "
        f"CheckpointManager.restore(like=state, items=[...{but}]). If layers were added, "
        f"dropped or renamed, pass partial=True, missing='keep' or transform= to "
        f"on_train_start or CheckpointManager.restore"
    )


def misfits(others: Any, *, but: str) -> list[str]:
    """The pytree items of ``others`` but ``but`` whose saved paths or shapes differ."""
    out = []
    for name, (loc, kind, like) in others.items():
        if name == but or kind != "pytree" or like is None:
            continue
        try:
            saved = {rec.path: tuple(rec.shape) for rec in read_document(loc).leaves}
            flat, _ = _tree.flatten(like)
            given = {path: tuple(np.shape(leaf)) for path, _, leaf in flat}
        except Exception:  # noqa: BLE001  (not compared: not named)
            continue
        if saved != given:
            out.append(name)
    return out


UNREAD_OK = frozenset({"extras", "data_iterator"})  # left out of a restore without a word


def warn_unread(step: int, location: Any, saved: Iterable[str], read: Iterable[str]) -> None:
    """Warns when a restore into ``like`` leaves out saved items (the run would lose them)."""
    unread = sorted(set(saved) - set(read) - UNREAD_OK)
    if unread:
        warnings.warn(
            f"step {step} of {location} holds item(s) {unread} that like does not have: "
            f"they are not restored, and the run goes on without them. Give like those "
            f"items; or, to leave them out on purpose, pass partial=True or items=[...] "
            f"(CheckpointCallback.on_train_start or CheckpointManager.restore)",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
