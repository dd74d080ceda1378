"""``flax-orbax gc --dry-run``: what ``gc`` would remove, found by reading only.

The rules of the writer's housekeeping and retention (``_manager.housekeeping``,
``_manager.retention``), asked without a writer: no lock, nothing written or removed.
A test runs both on one directory and compares their answers.
"""

from __future__ import annotations

import dataclasses

from .._core import ownership as _ownership
from .._core import writer_liveness as _liveness
from .._errors import CheckpointError, ForeignEntryError
from .._format import steps as _steps
from .._interop.safetensors import remains as _remains
from .._manager.housekeeping import rolls_forward
from .._manager.retention import Retention, sound_steps_to_delete
from .._storage.location import Location


@dataclasses.dataclass(frozen=True)
class GcPlan:
    """Names ``gc`` would remove (``unfinished`` entries, committed ``steps``, the
    ``exports`` that died left), the steps it would keep, the entries it leaves alone."""

    unfinished: list[str]
    steps: list[int]
    kept: list[int]
    left_alone: list[str]
    exports: list[str] = dataclasses.field(default_factory=list)


def plan(loc: Location, *, keep: int | None, keep_every: int | None) -> GcPlan:
    """What ``gc --keep keep --keep-every keep_every`` would do to ``loc`` now."""
    listing = _steps.list_directory(loc)
    finishing = [n for n in listing.unfinished if rolls_forward(loc, n, listing)]
    unfinished = [n for n in listing.unfinished if n not in finishing and _proven(loc.child(n))]
    foreign_gone = []
    kinds = loc.child_kinds() if loc.is_local else {}
    for name in listing.foreign:
        entry = loc.child(name)
        if loc.is_local:
            staging = kinds.get(name) == "dir" and _steps.SAVE_STAGING_RE.match(name)
            if staging and _liveness.is_dead(entry) and _proven(entry):
                foreign_gone.append(name)
        elif _steps.is_step_name(name) and _proven(entry):
            foreign_gone.append(name)
    committed = sorted(listing.committed)
    doomed: list[int] = []
    if keep is not None:
        policy = Retention(keep=keep, keep_every=keep_every).rule  # its checks, then rules
        doomed = sound_steps_to_delete(
            committed,
            policy,
            whole=lambda s: _steps.manifest_damage(loc, s) is None,
            protected=committed[-1:],
        )
    exports = _remains.dead(loc.path.rstrip("/")) if loc.is_local else []
    done = unfinished + foreign_gone + finishing + exports
    left = [n for n in listing.unfinished + listing.foreign if n not in done]
    return GcPlan(
        unfinished=unfinished + foreign_gone,
        steps=doomed,
        kept=[s for s in committed if s not in doomed],
        left_alone=left,
        exports=exports,
    )


def _proven(loc: Location) -> bool:
    """Whether housekeeping would remove ``loc``: proven ours, or an empty local folder."""
    try:
        if _ownership.proof(loc) is not None:
            return True
    except (ForeignEntryError, CheckpointError):
        return False
    return loc.is_local and _ownership.is_empty(loc)
