"""Which step an imported state is written as (Orbax and msgpack imports alike).

A foreign checkpoint may say its step three ways: the caller gives it (``step=``,
``--step``), the state holds it (a top-level ``step`` leaf, as a Flax ``TrainState``
has), or its name does (an Orbax step directory, ``checkpoint_<N>``). A given step
must equal the state's; without one the state's is taken (a name that differs is a
warning), else the name's; with none of them the import is refused, naming how to
give it: never a silent step 0. Pure functions; ``importing`` calls them per step.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .._errors import StructureError

__all__ = ["choose_step", "state_step"]

logger = logging.getLogger("flax_orbax_plugin")


def state_step(tree: Any, path: str) -> int | None:
    """The state's own step: its top-level ``step`` leaf (a Flax ``TrainState``'s),
    an integer scalar; None when it has none. StructureError for a ``step`` leaf that
    is a scalar but not an integer (a step cannot be guessed from it)."""
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
    """The step the state read from ``path`` is imported as: ``given`` by the caller
    (it must equal the state's own, ``stored``, when the state has one), else the
    state's, else the number its name gives (``named``); with none of them, an error
    asking for it. A name whose number differs from the state's step is logged as a
    warning (the state's is taken: ``flax.training.checkpoints`` and Orbax name steps
    by whatever number their caller passed)."""
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
