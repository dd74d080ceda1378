"""Opening the persistent tier (see ``docs/tiers.md``), called by ``PersistentTier.open``
on the training thread before the replicator starts: the primary's part, then (several
processes) its outcome shared in one key-value round, so all open alike or all raise.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable

from ..._base import distributed as _distributed
from ..._errors import CheckpointError, DirectoryLockedError
from ..._format import steps as _steps
from ..._format.foreign import foreign_run
from ..._storage import lease as _lease
from .damaged import DamagedSteps
from .replicator import remove_unfinished
from .rounds import Rounds
from .state import Places, TierState

__all__ = ["open_primary", "share_open"]


def open_primary(
    places: Places,
    state: TierState,
    damaged: DamagedSteps,
    local_steps: Iterable[int],
    lease_seconds: float,
) -> tuple[list[int], list[int], BaseException | None]:
    """Primary: takes both places for this run, reads the damage record, removes
    unfinished copies; returns the persistent steps, the local steps to queue and
    (several processes) the failure to share."""
    remote_steps: list[int] = []
    failure: BaseException | None = None
    try:
        held = foreign_run(places.remote)  # its run record would land inside that run
        if held is not None:
            raise CheckpointError(
                f"persistent path {places.remote} holds {held}: a tier writes steps of its "
                f"own run there; convert them first (`flax-orbax import`), or give the "
                f"tier a path of its own"
            )
        state.owner = _lease.RunOwner(
            places.local,
            places.remote,
            lease_seconds=lease_seconds,
            steps_of=_steps.committed_steps,
        )
        state.owner.open()  # this run's place, or DirectoryLockedError/CheckpointError
        damaged.steps = damaged.read()
        remove_unfinished(places.remote)
        remote_steps = damaged.committed_steps()
    except BaseException as e:
        if state.owner is not None:
            state.owner.close()
        if not places.multi:
            raise
        failure = e
    latest = remote_steps[-1] if remote_steps else -1
    missing = [
        s
        for s in local_steps
        if places.due(s) and s not in remote_steps and (s > latest or places.kept_forever(s))
    ]
    return remote_steps, missing, failure


def share_open(
    damaged: DamagedSteps,
    rounds: Rounds,
    remote_steps: list[int],
    missing: list[int],
    failure: BaseException | None,
    region: _distributed.Region | None,
) -> tuple[list[int], list[int]]:
    """Every process (in ``region``): the primary's persistent steps and steps to queue
    (returned), damage record and round prefix (set), or its error (raised)."""
    op = _distributed.next_operation_id("tiers-open", region=region)
    mine = {
        "remote": remote_steps,
        "missing": missing,
        "damaged": {str(k): v for k, v in damaged.steps.items()},
        "rounds": secrets.token_hex(6),
        "error": None if failure is None else [type(failure).__name__, str(failure)],
    }
    shared = json.loads(_distributed.broadcast_str(op, json.dumps(mine), region=region))
    if shared["error"] is not None:  # every process raises the primary's error
        if failure is not None:
            raise failure
        kind, text = shared["error"]
        cls = DirectoryLockedError if kind == "DirectoryLockedError" else CheckpointError
        raise cls(f"opening the persistent tier failed on the primary: {text}")
    damaged.steps = {int(k): v for k, v in shared["damaged"].items()}
    rounds.prefix = f"fop/{shared['rounds']}/replicate"
    return shared["remote"], shared["missing"]
