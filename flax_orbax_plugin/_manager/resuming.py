"""The callback's decisions when it does not restore: a run to refuse or clear, or none.

Called by CheckpointCallback on the training thread, after the manager opened
(``place_exists`` before that).
"""

from __future__ import annotations

import logging
from typing import Any

from .._core import ownership as _ownership
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import steps as _steps
from .._storage.location import Location
from .._storage.lock import LOCK_FILE

logger = logging.getLogger("flax_orbax_plugin")


def place_exists(directory: Any) -> bool:
    """Whether anything is stored at ``directory`` yet (before the manager opens it)."""
    try:
        return Location.from_path(directory).is_dir()
    except (OSError, ValueError):
        return True  # unknown: the warning then says "holds no committed step"


def no_run_to_resume(directory: Any, mngr: Any, resume: bool | str, existed: bool) -> None:
    """``resume`` is set and neither tier holds a step: an error, or a WARNING naming it."""
    aside = _steps.list_directory(Location.from_path(directory)).corrupt
    if aside:  # steps existed but none restored: never silently start from step 0
        raise CheckpointError(
            f"resume={resume!r} but every step of {directory} was set aside as damaged "
            f"({', '.join(aside)}); nothing was restored. Inspect them with "
            f"`flax-orbax verify`, or start fresh in a new directory"
        )
    if resume == "required":
        raise CheckpointNotFoundError(
            f"resume='required' but {directory} holds no committed checkpoint"
        )
    where = str(directory)
    if mngr.persistent is not None:
        where += f" (nor its persistent tier {mngr.persistent.remote})"
    what = "holds no committed step" if existed else "did not exist and was created"
    logger.warning(
        "checkpoint: resume=True but %s %s: nothing to resume, starting a new run there. "
        "If this job was meant to resume, check the path; resume='required' refuses to "
        "start fresh",
        where,
        what,
    )


def created_by_open(directory: Any) -> list[str]:
    """The local directories that opening ``directory`` will create, deepest first."""
    try:
        loc = Location.from_path(directory)
    except (OSError, ValueError):
        return []
    return _ownership.missing_directories(loc.path) if loc.is_local else []


def remove_created(directory: Any, mngr: Any, created: list[str]) -> None:
    """Closes ``mngr``; the lock and the empty ``created`` directories go if alone there."""
    mngr.close()
    if created and Location.from_path(directory).list_children() == [LOCK_FILE]:
        _ownership.remove_created(created, files=(LOCK_FILE,))


def refuse_or_clear(directory: Any, mngr: Any, latest: int, overwrite: bool) -> None:
    """``resume=False`` on a place holding steps: refused, or with ``overwrite`` emptied."""
    if not overwrite:
        where = "" if mngr.persistent is None else f" (or its tier {mngr.persistent.remote})"
        raise CheckpointError(
            f"{directory}{where} already holds steps of a run (latest: {latest}) and "
            f"resume=False: refusing to mix two runs. Resume it (resume=True), use a new "
            f"directory, or pass overwrite=True to remove its steps first. A job restarted "
            f"with the same command should run with resume=True from its first start (it "
            f"starts fresh while the directory holds no step)"
        )
    mngr.delete(*mngr.steps())  # collective: every process lists before any goes
    if mngr.persistent is not None:
        for step in mngr.persistent.steps():
            mngr.persistent.remove(step)
    logger.warning("checkpoint: overwrite=True: removed the steps in %s", directory)


def unstarted(directory: Any, mngr: Any, step: int, resume: bool | str, overwrite: bool) -> None:
    """A first step with no ``on_train_start``: an earlier run's steps are refused (or cleared)."""
    latest = mngr.latest_step(include_persistent=True)
    if latest is None or mngr.restored_step is not None:  # nothing to mix, or restored
        return
    if not resume:
        refuse_or_clear(directory, mngr, latest, overwrite)
        return
    raise CheckpointError(
        f"on_step_end({step}) before on_train_start, and {directory} holds step "
        f"{latest} of a run: call state = cb.on_train_start(state) before the loop to "
        f"resume it (resume={resume!r}), or start afresh elsewhere (a new "
        f"directory, or resume=False with overwrite=True)"
    )


def stale_step(step: int | None, saved: int | None, reached: int | None) -> None:
    """``on_train_end(state)``: a ``state.step`` below the step already ``saved`` is refused."""
    if step is None or saved is None or step >= saved:
        return
    reached = max(saved, reached or saved)
    raise CheckpointError(
        f"on_train_end(state): the step to save came from state.step, which is {step}, "
        f"below step {saved} this run already saved (it reached step {reached}): the loop "
        f"did not keep state.step up to date. Pass the step: on_train_end(state, "
        f"step={reached}) (nothing was saved; the run is not over)"
    )
