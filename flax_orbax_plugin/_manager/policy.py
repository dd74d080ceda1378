"""SavePolicy: which steps a CheckpointManager saves (a public option object).

A step is saved when any rule fires: it is in ``steps``; it is a multiple of
``every_steps``; at least ``every_seconds`` have passed since the last save (or since
the first decision: the first call starts the clock, as CLU's periodic actions do).
With no rule set every call saves; ``save(step, ..., ignore_policy=True)`` saves
whatever the policy says. The time comes from ``clock`` (or ``t`` from the caller), so
tests need no sleeps.

A policy is frozen and holds no state: the manager's ``schedule`` keeps the time of
the last save and asks :meth:`SavePolicy.wants`. That is the whole protocol of a save
policy (``wants(step, *, elapsed)`` and ``uses_time``), so combinations (any / all of
several policies, a save on preemption, an initial save) can be objects of their own
later, taken by the same ``policy=`` option.

Each field is declared once (:data:`FIELDS`): the manager's shorthands
(``every_steps=``, ``every_seconds=``, ``steps=``, ``clock=``) are the same
declarations, so a bad value is refused with the same words either way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from .._base.option_spec import Option, check, found, refuse_without

__all__ = ["FIELDS", "SavePolicy"]


def _steps(value: Any) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"expected an iterable of int steps, found {found(value)}")
    out = []
    for s in value:
        if isinstance(s, bool) or not hasattr(s, "__index__"):
            raise TypeError(f"expected int steps, found {found(s)}")
        if int(s) < 0:
            raise ValueError(f"expected steps >= 0, found {s!r}")
        out.append(int(s))
    return out


EVERY_STEPS = Option(
    "every_steps",
    "int",
    none_ok=True,
    low=1,
    expected="a positive int or None",
    doc="save when step % every_steps == 0",
    aliases=(
        "save_interval_steps",
        "save_every",
        "save_every_steps",
        "save_steps",
        "every_n_steps",
        "checkpoint_every_steps",
    ),
)
EVERY_SECONDS = Option(
    "every_seconds",
    "number",
    none_ok=True,
    low=0,
    low_open=True,
    high=threading.TIMEOUT_MAX,
    expected=f"a number of seconds > 0 and <= {threading.TIMEOUT_MAX:g} or None",
    doc="save when this many seconds passed since the last save (or the first call)",
    aliases=(
        "every_secs",
        "every_n_secs",
        "save_interval_secs",
        "save_interval_seconds",
        "save_every_seconds",
    ),
)
STEPS = Option(
    "steps",
    "custom",
    none_ok=True,
    convert=_steps,
    annotation="Iterable[int]",
    doc="also save these steps",
    aliases=("save_on_steps", "save_steps_list"),
)
CLOCK = Option(
    "clock",
    "callable",
    default=time.monotonic,
    annotation="Callable[[], float]",
    doc="the time source of every_seconds (tests pass one in)",
)
FIELDS: tuple[Option, ...] = (EVERY_STEPS, EVERY_SECONDS, STEPS, CLOCK)
"""The fields of :class:`SavePolicy`, which are also the manager's shorthands."""


@dataclass(frozen=True)
class SavePolicy:
    """Which steps to save; see the module docstring. Every field is optional.

    ``SavePolicy(every_steps=1000)``, ``SavePolicy(every_seconds=600, steps=[1])``:
    checked when made (OptionError naming the field); ``steps`` is kept as a frozenset.
    Frozen: share one between managers freely. Any thread.
    """

    _: KW_ONLY
    every_steps: int | None = None
    every_seconds: float | None = None
    steps: Iterable[int] | None = None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        values = check(FIELDS, {o.name: getattr(self, o.name) for o in FIELDS})
        if values["steps"] is not None:
            values["steps"] = frozenset(values["steps"])
        for name, value in values.items():
            object.__setattr__(self, name, value)
        if self.every_seconds is None:
            refuse_without(
                "clock", self.clock, "every_seconds= (the time it measures)", default=CLOCK.default
            )

    @property
    def always(self) -> bool:
        """No rule set: every step is saved."""
        return self.every_steps is None and self.every_seconds is None and not self.steps

    @property
    def uses_time(self) -> bool:
        """Whether a decision depends on the time (then one process decides for all)."""
        return self.every_seconds is not None

    def wants(self, step: int, *, elapsed: float) -> bool:
        """Whether ``step`` is to be saved, ``elapsed`` seconds after the last save (or
        after the first decision, before any save)."""
        if self.always or step in (self.steps or ()):
            return True
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and elapsed >= self.every_seconds
