"""Which step an imported state is written as (Orbax and msgpack imports alike).

A foreign checkpoint may say its step three ways: the caller gives it (``step=``,
``--step``), the state holds it (a top-level ``step`` leaf, as a Flax ``TrainState``
has), or its name does (an Orbax step directory, ``checkpoint_<N>``). A given step
must equal the state's; without one the state's is taken (a name that differs is a
warning), else the name's; with none of them the import is refused, naming how to
give it: never a silent step 0 (:func:`choose_step`, :func:`state_step`: pure,
called per step). Before anything is written, :func:`orbax_steps_to_import` names the
Orbax steps an import writes (reading names and metadata), and :func:`refuse_mixing`
refuses steps of the output directory that the import would hide or replace.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

from .._base.option_spec import outside_stacklevel
from .._errors import StructureError
from .._format.foreign import is_step
from .._storage.location import Location
from .orbax_layout import open_orbax
from .orbax_steps import list_steps

__all__ = [
    "choose_step",
    "orbax_steps_to_import",
    "refuse_existing",
    "refuse_mixing",
    "state_step",
]

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


def orbax_steps_to_import(src: Any, step: int | None) -> list[tuple[int, Location]]:
    """``[(step number, step directory)]`` that importing ``src`` writes: every committed
    step of an Orbax manager directory (or only ``step``), or a lone step or item
    directory as ``step`` (default: its own number, else 0). Reads names and metadata."""
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
            sorted(listing.steps),
            ", ".join(passed),
        )
    return list(listing.steps.items())


def refuse_mixing(out_dir: Any, held: list[int], planned: list[int], force: bool) -> None:
    """Before anything is written: a planned step that exists is refused (unless
    ``force``: replaced), and so are steps newer than every planned one (a resume would
    take one of those, not the import); older steps kept beside the import warn."""
    if force or not held:
        return
    refuse_existing(out_dir, held, planned, force)
    newer = [s for s in held if planned and s > max(planned)]
    if newer:
        raise FileExistsError(
            f"{out_dir} already holds steps newer than those imported ({_shown(newer)}): a "
            "resume would take them, not the import; import into a new directory, or pass "
            "force=True (--force) to add these steps beside them"
        )
    warnings.warn(
        f"{out_dir} already holds steps {_shown(held)}; the imported steps are added beside "
        "them (one run directory holding two runs' steps, if they came from elsewhere)",
        UserWarning,
        stacklevel=outside_stacklevel(),
    )


def refuse_existing(out_dir: Any, held: list[int], numbers: list[int], force: bool) -> None:
    """Unless ``force`` (replace them): FileExistsError for the first of ``numbers`` that
    ``out_dir`` already holds (``held``)."""
    clash = [] if force else sorted(set(held) & set(numbers))
    if clash:
        raise FileExistsError(
            f"{out_dir}: step {clash[0]} exists already; pass force=True (--force) to replace it"
        )


def _shown(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
