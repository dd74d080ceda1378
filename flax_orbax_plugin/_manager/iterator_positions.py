"""A data iterator's saved position, read back onto another number of processes.

A step's ``data_iterator`` item holds one file per saving process,
``{"state": ..., "global_position": n}``, the second field present when the
iterator declared a position that does not depend on the process count
(``_state.global_position``). When the restoring processes are as many as the saving
ones, each reads its own file. When they are not, :func:`position_across_counts`
reads process 0's file and, where it exists, this process's own, checks that both
hold the same global position, and returns it; each restoring process then
continues from it on its own share. A state without a global position is refused,
naming both counts and why.

Pure reads; called on the restoring thread of each process (no collective: every
process reads the same small files).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .._errors import CorruptCheckpointError, StructureError
from .._state import global_position as _global
from .json_items import from_json

__all__ = ["position_record", "position_across_counts", "restore_across_counts"]


def position_record(value: Any, state: Any) -> dict[str, Any]:
    """The fields a process's iterator file holds beside ``state``: the global
    position of ``value`` where it declares one."""
    position = _global.global_position(value, state)
    return {} if position is None else {_global.GLOBAL_POSITION_KEY: position}


def saved_position(data: Any, where: str) -> int | None:
    """The global position recorded in a process's iterator file (None: none)."""
    if not isinstance(data, dict) or _global.GLOBAL_POSITION_KEY not in data:
        return None
    value = data[_global.GLOBAL_POSITION_KEY]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CorruptCheckpointError(
            f"{where}: 'global_position' must be a non-negative int, found {value!r}"
        )
    return value


def position_across_counts(
    directory: Any,
    like: Any,
    *,
    saved: int,
    restoring: int,
    process: int,
    read: Callable[[int], Any],
) -> int:
    """The global position to continue from, for a step whose iterator states were
    saved by ``saved`` processes and are restored by ``restoring`` (``process`` is this
    one); ``read(i)`` returns process i's decoded file. Raises StructureError naming
    both counts when the saved position is per process, the processes saved different
    positions, or ``like`` cannot take a global position."""
    head = (
        f"{directory}: the data iterator states were saved by {saved} process(es) but "
        f"{restoring} are restoring"
    )
    advice = (
        f"Restore without the data_iterator item and re-seed the pipeline, or use an "
        f"iterator whose state can be re-sharded: {_global.describe()}"
    )
    names = [0] if process == 0 or process >= saved else [0, process]
    positions = {i: saved_position(read(i), f"{directory}/process_{i}.json") for i in names}
    if any(p is None for p in positions.values()):
        raise StructureError(
            f"{head}; each process's position is its own (the saved iterator declared "
            f"no global position). {advice}"
        )
    if len(set(positions.values())) > 1:
        found = ", ".join(f"process {i}: {p}" for i, p in positions.items())
        raise StructureError(
            f"{head}; the saved global positions differ ({found}): the processes had not "
            f"drawn the same number of global batches, so no one position continues them all"
        )
    if like is not None and not _global.can_set(like):
        raise StructureError(
            f"{head}; the step holds a global data position but the iterator given "
            f"(a {type(like).__name__}) has no set_global_position() to continue from it. "
            f"{advice}"
        )
    return positions[0]


def restore_across_counts(
    directory: Any, like: Any, manifest: Any, *, read: Callable[[int], Any]
) -> Any:
    """The data_iterator item of a step saved by ``manifest.process_count`` processes,
    restored onto this job's count: ``like`` continued from the saved global position
    (with ``like=None``, process 0's saved state, the same on every process)."""
    position = position_across_counts(
        directory,
        like,
        saved=manifest.process_count,
        restoring=jax.process_count(),
        process=jax.process_index(),
        read=read,
    )
    if like is None:
        return from_json(read(0)["state"])
    _global.set_global_position(like, position)
    return like
