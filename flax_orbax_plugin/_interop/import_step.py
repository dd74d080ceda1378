"""Which step, and which items, an imported state is written as: pure functions,
called per step before anything is written.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._interop.import_step``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._base import shown as _shown
from .._base.shown import outside_stacklevel
from .._errors import StructureError
from .._format.foreign import is_step
from .._storage.location import Location
from .orbax_layout import open_orbax
from .orbax_steps import list_steps

logger = logging.getLogger("flax_orbax_plugin")


def state_step(tree: Any, path: str) -> int | None:
    """The state's top-level ``step`` leaf (a ``TrainState``'s) as an int, or None;
    StructureError for a scalar ``step`` that is no non-negative integer."""
    if not isinstance(tree, dict) or "step" not in tree:
        return None
    value = tree["step"]
    if isinstance(value, dict | list | str | bytes) or value is None:
        return None  # a subtree named step, not a step
    arr = np.asarray(value)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer) or int(arr) < 0:
        raise StructureError(
            f"leaf 'step' in {path}: expected a non-negative integer scalar (the state's "
            f"step), found {arr.dtype}{list(arr.shape)}"
        )
    return int(arr)


def choose_step(path: str, *, given: int | None, named: int | None, stored: int | None) -> int:
    """The step the state read from ``path`` is imported as: ``given`` (it must equal
    the state's own, ``stored``), else ``stored`` (a differing ``named`` is warned
    of), else the number its name gives (``named``), else a StructureError."""
    if given is not None:
        if stored is not None and stored != given:
            raise StructureError(
                f"{path}: step {given} was asked for, but the state's step leaf says "
                f"{stored}; import it as step {stored} (or leave the step out)"
            )
        return given
    if stored is not None:
        if named is not None and named != stored:
            logger.warning(
                "import: %s is named for step %d but its state's step leaf says %d: "
                "imported as step %d (pass step= to choose)",
                path,
                named,
                stored,
                stored,
            )
        return stored
    if named is not None:
        return named
    raise StructureError(
        f"{path}: no step to import it as: the state has no top-level 'step' leaf and "
        f"its name no step number; give it (step= in Python, --step on the command line)"
    )


def orbax_steps_to_import(src: Any, step: int | None) -> list[tuple[int, Location]]:
    """``[(step number, step directory)]`` importing ``src`` writes: every committed
    step of an Orbax run (or only ``step``), or a lone step or item as ``step`` (default:
    its own number, else 0)."""
    loc = Location.from_path(src)
    if is_step(loc):
        own, _ = open_orbax(loc)
        return [(step if step is not None else (own if own is not None else 0), loc)]
    listing = list_steps(loc)
    if step is not None:
        return [(listing.choose(step), listing.steps[step])]
    if not listing.steps:
        listing.choose(None)  # an error naming what was passed over
    passed = listing.skipped_above(None)
    if passed:
        logger.warning(
            "%s: importing Orbax steps %s; passed over (not finalized steps): %s",
            loc,
            _shown.listed(sorted(listing.steps)),
            _shown.listed(passed),
        )
    return list(listing.steps.items())


def refuse_mixing(out_dir: Any, held: list[int], planned: list[int], force: bool) -> None:
    """Unless ``force``: refuses a planned step that exists and steps newer than every
    planned one (a resume would take those); warns of older steps beside the import."""
    if force or not held:
        return
    refuse_existing(out_dir, held, planned, force)
    newer = [s for s in held if planned and s > max(planned)]
    if newer:
        raise FileExistsError(
            f"{out_dir} already holds steps newer than those imported ({_steps_text(newer)}): a "
            "resume would take them; import into a new directory, or pass force=True (--force)"
        )
    warnings.warn(
        f"{out_dir} already holds steps {_steps_text(held)}; the imported steps are added beside "
        "them (one run directory holding two runs' steps, if they came from elsewhere)",
        UserWarning,
        stacklevel=outside_stacklevel(),
    )


def refuse_existing(out_dir: Any, held: list[int], numbers: list[int], force: bool) -> None:
    """Unless ``force``: FileExistsError for the first of ``numbers`` in ``held``."""
    clash = [] if force else sorted(set(held) & set(numbers))
    if clash:
        raise FileExistsError(
            f"{out_dir}: step {clash[0]} exists already; to replace it pass force=True "
            f"(--force on the command line)"
        )


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")


# -- which items an imported state becomes ------------------------------------------


ImportedStep = tuple[int, dict[str, Any], dict[str, Any] | None]  # (step, items, extras)


def _to_step_int(value: Any, source: str) -> int:
    arr = np.asarray(value)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer):
        raise StructureError(
            f"leaf 'step' in {source}: expected an integer scalar, "
            f"found {arr.dtype}{list(arr.shape)}"
        )
    return int(arr)


def _split(tree: Any, source: str) -> dict[str, Any]:
    """A training-state dict (it has 'params') gives one item per top-level key (empty
    ones too, as this library's save keeps them); any other tree is ``params``."""
    if isinstance(tree, Mapping) and "params" in tree:
        return {
            str(key): _to_step_int(value, source) if key == "step" else value
            for key, value in tree.items()
        }
    return {"params": tree}


def step_items(trees: Mapping[str, Any], kinds: Mapping[str, str], *, source: str) -> ImportedStep:
    """Maps a foreign step's items onto this plugin's checkpointables: a pytree item
    holding a training state (:func:`_split`) gives its keys as items, another is kept
    by name (a lone one is ``params``); JSON items go into ``extras`` by name, but the
    entries of Orbax's ``metrics`` item become top-level extras (``keep_best`` reads
    them there). Returns ``(-1, items, extras)``: the caller decides the step.
    """
    pytrees = {n: t for n, t in trees.items() if kinds[n] == "pytree" and t is not None}
    extras = {n: t for n, t in trees.items() if kinds[n] == "json" and n != "metrics"}
    metrics = trees.get("metrics") if kinds.get("metrics") == "json" else None
    if isinstance(metrics, Mapping):
        clash = sorted(set(metrics) & set(extras))
        if clash:
            raise StructureError(
                f"metric {clash[0]!r} of {source}: also the name of a JSON item; import "
                f"one of them only"
            )
        extras.update(metrics)
    elif metrics is not None:
        extras["metrics"] = metrics
    items: dict[str, Any] = {}
    origin: dict[str, str] = {}  # our item -> the foreign item it came from
    for name, tree in pytrees.items():
        parts = _split(tree, source) if name != "params" else {"params": tree}
        if len(pytrees) > 1 and set(parts) == {"params"} and name != "params":
            parts = {name: tree}  # one of several items, no training state: kept by name
        clash = sorted(set(parts) & set(items))
        if clash:
            raise StructureError(
                f"item {clash[0]!r} of {source}: found in two Orbax items; import them "
                f"one at a time"
            )
        items.update(parts)
        origin.update(dict.fromkeys(parts, name))
    _refuse_reserved(items, origin, source)
    if "step" in items and not isinstance(items["step"], int):
        items["step"] = _to_step_int(items["step"], source)
    return -1, items, extras or None


# Item names whose kind this library fixes: a tree saved under one would not come back.
_RESERVED = {
    "extras": "the step's JSON extras (extras=)",
    "data_iterator": "a data iterator's state (data_iterator=)",
}


def _refuse_reserved(items: Mapping[str, Any], origin: Mapping[str, str], source: str) -> None:
    """StructureError for a tree imported under a name reserved for another kind."""
    for name, what in _RESERVED.items():
        if name in items:
            came = origin.get(name, name)
            where = f"Orbax item {name!r}" if came == name else f"key {name!r} of item {came!r}"
            raise StructureError(
                f"item {name!r} of {source}: a tree ({where}), but this library reserves "
                f"the item name {name!r} for {what}; nothing of this step was imported: "
                f"save the tree under another item name"
            )
