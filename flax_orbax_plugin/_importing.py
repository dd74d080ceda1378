"""Turning a foreign checkpoint's trees into a step of a ``CheckpointManager`` directory.

Shared by the Orbax and msgpack importers. Who calls what: an importer reads one
foreign step into ``{item name: tree or JSON value}``, maps it with
:func:`step_items`, and hands an iterator of steps to :func:`save_steps`, which
writes each through the public ``CheckpointManager.save`` (so the on-disk layout
is exactly what a training job writes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._errors import StructureError

__all__ = ["save_steps", "step_items", "ImportedStep"]

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
    """A training-state dict (it has 'params') gives one item per top-level key."""
    if isinstance(tree, Mapping) and "params" in tree:
        out = {}
        for key, value in tree.items():
            if value is None or (isinstance(value, Mapping) and not value):
                continue  # nothing to save (a static field, an empty optimizer state)
            out[str(key)] = _to_step_int(value, source) if key == "step" else value
        return out
    return {"params": tree}


def step_items(trees: Mapping[str, Any], kinds: Mapping[str, str], *, source: str) -> ImportedStep:
    """Maps a foreign step's items onto this plugin's checkpointables.

    * one pytree item (a lone ``StandardSave``, a msgpack file): a dict with a
      ``params`` key is a training state, each top-level key an item (``params``,
      ``opt_state``, ``step`` ...); any other tree becomes ``params``;
    * several items: an item named like one of ours is kept by name; a pytree item
      holding a training state is split as above; any other pytree is kept by name;
    * JSON items go into ``extras`` under their item name.

    Returns ``(step, items, extras)`` with step left as -1 (the caller decides).
    """
    pytrees = {n: t for n, t in trees.items() if kinds[n] == "pytree" and t is not None}
    extras = {n: t for n, t in trees.items() if kinds[n] == "json"}
    items: dict[str, Any] = {}
    if len(pytrees) == 1:
        ((name, tree),) = pytrees.items()
        items = _split(tree, source) if name != "params" else {"params": tree}
    else:
        for name, tree in pytrees.items():
            parts = _split(tree, source) if name != "params" else {"params": tree}
            if set(parts) == {"params"} and name != "params":
                parts = {name: tree}
            clash = sorted(set(parts) & set(items))
            if clash:
                raise StructureError(
                    f"item {clash[0]!r} of {source}: found in two Orbax items; import them "
                    f"one at a time"
                )
            items.update(parts)
    if "step" in items and not isinstance(items["step"], int):
        items["step"] = _to_step_int(items["step"], source)
    return -1, items, extras or None


def save_steps(
    out_dir: Any, steps: Iterable[tuple[int, ImportedStep]], *, force: bool
) -> list[int]:
    """Saves each ``(step, (_, items, extras))`` as a committed step of ``out_dir``.

    A step that already exists there is an error unless ``force`` (then replaced).
    Returns the steps written, in order.
    """
    from ._manager import CheckpointManager

    written = []
    with CheckpointManager(out_dir, async_save=False) as mngr:
        for number, (_, items, extras) in steps:
            if not force and number in mngr.steps():
                raise FileExistsError(
                    f"{out_dir}: step {number} exists already; pass force=True (--force) "
                    f"to replace it"
                )
            # overwrite: an imported step may lie below the latest one (no training run
            # is resumed here); an existing step was refused above unless force.
            mngr.save(number, items, extras=extras, force=True, overwrite=True)
            written.append(number)
    return written


def import_checkpoint(
    src: Any, out_dir: Any, *, step: int | None = None, force: bool = False
) -> list[int]:
    """``flax-orbax import``: an Orbax directory or Flax msgpack file(s) into ``out_dir``.

    Orbax (a manager, step or item directory) goes through
    :func:`flax_orbax_plugin._orbax_import.import_orbax`; a msgpack file or a
    ``flax.training.checkpoints`` directory through
    :func:`flax_orbax_plugin._msgpack_import.import_msgpack`. Returns the steps written.
    """
    import os

    from ._errors import CheckpointNotFoundError
    from ._msgpack_import import import_msgpack
    from ._orbax_import import import_orbax, is_orbax_checkpoint

    if is_orbax_checkpoint(src):
        return import_orbax(src, out_dir, step=step, force=force)
    if os.path.exists(os.fspath(src)):
        return import_msgpack(src, out_dir, step=step, force=force)
    raise CheckpointNotFoundError(f"{src}: no such file or directory")
