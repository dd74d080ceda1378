"""SavePolicy: which steps a CheckpointManager saves (a public option object).

A step is saved when any rule fires: it is in ``steps``; it is a multiple of
``every_steps``; at least ``every_seconds`` have passed since the last save (or since
the first decision: the first call starts the clock, as CLU's periodic actions do).
With no rule set every call saves; ``save(step, ..., ignore_policy=True)`` saves
whatever the policy says. The time comes from ``clock`` (or ``t`` from the caller), so
tests need no sleeps.

A policy is frozen and holds no state: the manager's ``schedule`` keeps the time of
the last save and asks the policy's :attr:`SavePolicy.rule`: the composable objects
of ``save_rules`` (``AtSteps | EverySteps | EverySeconds``; ``EverySteps(1)`` with no
rule set), so the shorthands and the objects take one path. A SavePolicy is a save
policy itself: ``SavePolicy(every_steps=1000) | fop.OnPreemption()`` works.

Each field is declared once (:data:`FIELDS`): the manager's shorthands
(``every_steps=``, ``every_seconds=``, ``steps=``, ``clock=``) are the same
declarations, so a bad value is refused with the same words either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass

from .._base.env import Option, check, refuse_without
from .save_rules import (
    MAX_SECONDS,
    AnyOf,
    AtSteps,
    EverySeconds,
    EverySteps,
    Moment,
    SaveRule,
    step_set,
)

__all__ = ["FIELDS", "SavePolicy"]


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
    high=MAX_SECONDS,
    expected=f"a number of seconds > 0 and <= {MAX_SECONDS:g} or None",
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
    convert=lambda value: step_set(value, "steps"),
    annotation="Iterable[int]",
    doc="also save these steps",
    aliases=("save_on_steps", "save_steps_list"),
)
CLOCK = Option(
    "clock",
    "callable",
    default=time.monotonic,
    annotation="Callable[[], float]",
    doc="the time source of every_seconds, EverySeconds, Continuous and KeepFor (tests pass one)",
)
FIELDS: tuple[Option, ...] = (EVERY_STEPS, EVERY_SECONDS, STEPS, CLOCK)
"""The fields of :class:`SavePolicy`, which are also the manager's shorthands."""


@dataclass(frozen=True)
class SavePolicy(SaveRule):
    """Which steps to save; see the module docstring. Every field is optional.

    ``SavePolicy(every_steps=1000)``, ``SavePolicy(every_seconds=600, steps=[1])``:
    checked when made (OptionError naming the field); ``steps`` as ``AtSteps`` keeps it.
    Frozen: share one between managers freely. Any thread.
    """

    _: KW_ONLY
    every_steps: int | None = None
    every_seconds: float | None = None
    steps: Iterable[int] | None = None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        values = check(FIELDS, {o.name: getattr(self, o.name) for o in FIELDS})
        for name, value in values.items():
            object.__setattr__(self, name, value)
        if self.every_seconds is None:
            refuse_without(
                "clock", self.clock, "every_seconds= (the time it measures)", default=CLOCK.default
            )

    @property
    def always(self) -> bool:
        """Whether no rule is set (then every step is saved)."""
        return self.every_steps is None and self.every_seconds is None and not self.steps

    @property
    def uses_time(self) -> bool:  # type: ignore[override]
        """Whether a decision depends on the time (then one process decides for all)."""
        return self.every_seconds is not None

    @property
    def rule(self) -> SaveRule:
        """The same policy as the composable objects (``save_rules``)."""
        parts: list[SaveRule] = []
        if self.steps:
            parts.append(AtSteps(self.steps))
        if self.every_steps is not None:
            parts.append(EverySteps(self.every_steps))
        if self.every_seconds is not None:
            parts.append(EverySeconds(self.every_seconds))
        if not parts:
            return EverySteps(1)
        return parts[0] if len(parts) == 1 else AnyOf(*parts)

    def wants(self, moment: Moment | int, *, elapsed: float = 0.0) -> bool:  # type: ignore[override]
        """Whether the step of ``moment`` is to be saved; ``wants(step, elapsed=s)``:
        ``s`` seconds after the last save (or the first decision, before any save)."""
        if not isinstance(moment, Moment):
            moment = Moment(int(moment), since_save=elapsed)
        return self.rule.wants(moment)
