"""A data position that does not depend on the process count: the global position.

Call order: one thread (the training loop's) reads and sets the position.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._state.global_position``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GLOBAL_POSITION_KEY", "global_position", "set_global_position", "describe"]

GLOBAL_POSITION_KEY = "global_position"  # the field of a process's iterator file

_GRAIN_ELASTIC = ("ElasticIterator", "_ElasticMapDatasetIterator")  # grain's elastic classes
_GRAIN_ELASTIC_KEY = "global_next_index"  # their state's one field


def _grain_elastic(it: Any) -> bool:
    kind = type(it)
    return kind.__module__.startswith("grain.") and kind.__name__ in _GRAIN_ELASTIC


def _index(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: expected a non-negative int, found {value!r}")
    return value


def global_position(it: Any, state: Any) -> int | None:
    """The global position of ``it`` (its ``state`` just read), or None where it has none."""
    if callable(getattr(it, "global_position", None)) and callable(
        getattr(it, "set_global_position", None)
    ):
        return _index(it.global_position(), f"{type(it).__name__}.global_position()")
    if _grain_elastic(it) and isinstance(state, dict) and _GRAIN_ELASTIC_KEY in state:
        return _index(state[_GRAIN_ELASTIC_KEY], f"grain {type(it).__name__} state")
    return None


def can_set(it: Any) -> bool:
    """Whether ``it`` can continue from a global position."""
    return callable(getattr(it, "set_global_position", None)) or _grain_elastic(it)


def set_global_position(it: Any, position: int) -> None:
    """Has ``it`` continue from global position ``position`` (see the module docstring)."""
    if callable(getattr(it, "set_global_position", None)):
        it.set_global_position(position)
    elif _grain_elastic(it):
        it.set_state({_GRAIN_ELASTIC_KEY: position})
    else:
        raise TypeError(f"a {type(it).__name__} has no global position to set; {describe()}")


def describe() -> str:
    """What an iterator needs for its position to move across a change of process count."""
    return (
        "an iterator whose position is a global index (fop.StepIndexedIterator, grain's "
        "ElasticIterator, or one with global_position() and set_global_position()) "
        "resumes on any number of processes"
    )
