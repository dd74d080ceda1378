"""Save policies as small composable objects: which steps a CheckpointManager saves.

Each policy is a frozen value asked one question, :meth:`SaveRule.wants`, about one
:class:`Moment` (the step, the time, what the manager knows of its last save); it
holds no state, so one policy may be shared between managers. The manager's
``schedule`` builds the moment; the shorthands (``every_steps=``, ``every_seconds=``,
``steps=``, and ``SavePolicy``) produce these same objects (``SavePolicy.rule``).

* :class:`EverySteps` ``(n)``: ``step % n == 0``;
* :class:`EverySeconds` ``(t)``: ``t`` seconds since the last save (or the first
  decision: the first call starts the clock, as CLU's periodic actions do);
* :class:`AtSteps` ``(steps)``: these steps;
* :class:`OnPreemption` ``()``: the step every process agreed to save before stopping
  (``preemption``: jax's sync point with several processes), once;
* :class:`InitialSave` ``()``: the first step asked about when the directory holds no
  step;
* :class:`Continuous` ``(max_overhead_percent=p)``: whenever the previous save is done
  and the time the last save blocked the loop is at most ``p`` percent of the time since
  it started (the manager's own timings, on its clock);
* :class:`AnyOf` / :class:`AllOf` (``a | b``, ``a & b``).

A decision that depends on the time or on the save in flight (:attr:`SaveRule.uses_time`)
is taken by the primary and shared with every process (``schedule``); the others
depend only on the step and on what every process knows alike.

Pure values; any thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._base.env import Option, found
from .._errors import OptionError, OptionTypeError

__all__ = [
    "AllOf",
    "AnyOf",
    "AtSteps",
    "Continuous",
    "EverySeconds",
    "EverySteps",
    "InitialSave",
    "Moment",
    "OnPreemption",
    "SaveRule",
    "check_rule",
]

MAX_SECONDS = 1e9  # seconds: about 31 years, below threading.TIMEOUT_MAX everywhere


@dataclass(frozen=True)
class Moment:
    """What a save policy is asked about: ``step`` at time ``now``; ``since_save``:
    seconds since the last save started (or since the first decision, before any);
    ``has_steps``: the directory holds a committed step or this manager saved one;
    ``in_flight``: the previous save's background phase still runs; ``preempted``:
    ``step`` is the step to save before stopping (asked once per step, see
    ``preemption``); ``last_blocking``: seconds the last save blocked the training
    loop (None before any)."""

    step: int
    now: float = 0.0
    since_save: float = 0.0
    has_steps: bool = False
    in_flight: bool = False
    preempted: bool = False
    last_blocking: float | None = None


class SaveRule:
    """The protocol of a save policy: :meth:`wants`, :attr:`uses_time`,
    :attr:`watches_preemption`; ``|`` and ``&`` combine two policies."""

    uses_time = False  # the decision depends on the time or the save in flight
    watches_preemption = False  # the manager must learn of preemption notices

    def wants(self, moment: Moment) -> bool:  # pragma: no cover - the protocol
        raise NotImplementedError

    def label(self, moment: Moment) -> str | None:
        """The lane ``moment``'s step is saved in (``"save"`` outside lanes), or None
        when it is not saved (``lanes.Lanes`` names its lanes)."""
        return "save" if self.wants(moment) else None

    def __or__(self, other: Any) -> AnyOf:
        return AnyOf(self, other)

    def __and__(self, other: Any) -> AllOf:
        return AllOf(self, other)


def check_rule(value: Any, where: str) -> SaveRule:
    """``value`` if it is a save policy, else OptionTypeError naming ``where``."""
    if not isinstance(value, SaveRule):
        raise OptionTypeError(
            f"{where} must be a save policy (fop.EverySteps(n), fop.EverySeconds(t), "
            f"fop.OnPreemption(), fop.InitialSave(), fop.Continuous(...), fop.AnyOf(...), "
            f"fop.AllOf(...), fop.SavePolicy(...)), found {found(value)}"
        )
    return value


_N = Option("EverySteps(n)", "int", low=1)
_T = Option(
    "EverySeconds(seconds)",
    "number",
    low=0,
    low_open=True,
    high=MAX_SECONDS,
)
_PERCENT = Option("Continuous(max_overhead_percent)", "number", low=0, low_open=True, high=100)


@dataclass(frozen=True)
class EverySteps(SaveRule):
    """Saves when ``step % n == 0`` (``n`` >= 1; ``EverySteps(1)``: every step)."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _N.check(self.n))

    def wants(self, moment: Moment) -> bool:
        return moment.step % self.n == 0


@dataclass(frozen=True)
class EverySeconds(SaveRule):
    """Saves when ``seconds`` (> 0) passed since the last save (or the first decision)."""

    seconds: float
    uses_time = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds", _T.check(self.seconds))

    def wants(self, moment: Moment) -> bool:
        return moment.since_save >= self.seconds


MAX_LISTED_STEPS = 1_000_000  # steps named one by one; more: a range, or every_steps


def step_set(steps: Any, where: str) -> frozenset | range:
    """The steps a rule saves, checked (OptionError / OptionTypeError naming ``where``):
    a ``range`` stays a range (``range(10**12)`` costs nothing), any other iterable
    becomes a frozenset of ints >= 0 (at most :data:`MAX_LISTED_STEPS`); never empty
    (a rule that never saves: a list built empty by mistake)."""
    if isinstance(steps, str | bytes) or not isinstance(steps, Iterable):
        raise OptionTypeError(f"{where} must be an iterable of int steps, found {found(steps)}")
    if isinstance(steps, range):
        if steps and min(steps[0], steps[-1]) < 0:  # its ends (min() would walk it)
            raise OptionError(f"{where} must hold steps >= 0, found {steps!r}")
        out: frozenset | range = steps
    else:
        checker, listed = Option(where, "int", low=0), []
        for s in steps:
            if len(listed) == MAX_LISTED_STEPS:
                raise OptionError(
                    f"{where} names more than {MAX_LISTED_STEPS:,} steps one by one: pass a "
                    f"range (kept as it is) or every_steps="
                )
            listed.append(checker.check(s))
        out = frozenset(listed)
    if not out:
        raise OptionError(f"{where} must name at least one step, found {found(steps)}")
    return out


@dataclass(frozen=True)
class AtSteps(SaveRule):
    """Saves these steps (ints >= 0: a range stays a range, anything else is kept as a
    frozenset; see ``step_set``)."""

    steps: frozenset | range

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", step_set(self.steps, "AtSteps(steps)"))

    def wants(self, moment: Moment) -> bool:
        return moment.step in self.steps


@dataclass(frozen=True)
class OnPreemption(SaveRule):
    """Saves the step every process agreed to save before stopping, once (the
    manager then installs the preemption notice, as ``handle_sigterm=True`` does; without
    ``handle_sigterm`` the loop goes on and ``mngr.preempted`` says it should stop)."""

    watches_preemption = True

    def wants(self, moment: Moment) -> bool:
        return moment.preempted


@dataclass(frozen=True)
class InitialSave(SaveRule):
    """Saves the first step asked about when the directory holds no committed step.
    Decided by the primary (each host's own directory may list other steps)."""

    uses_time = True  # the primary's decision, shared (see the module docstring)

    def wants(self, moment: Moment) -> bool:
        return not moment.has_steps


@dataclass(frozen=True)
class Continuous(SaveRule):
    """Saves whenever the previous save is done, and the last save's blocking time is
    at most ``max_overhead_percent`` (0 < p <= 100) percent of the time since it began:
    the loop spends at least ``100 / p`` times a save's blocking time between saves.
    Measured by the manager on its clock (``clock=``; or ``t`` passed to ``save``)."""

    max_overhead_percent: float = 10.0
    uses_time = True

    def __post_init__(self) -> None:
        value = _PERCENT.check(self.max_overhead_percent)
        object.__setattr__(self, "max_overhead_percent", value)

    def wants(self, moment: Moment) -> bool:
        if moment.in_flight:
            return False
        if moment.last_blocking is None:
            return True
        budget = moment.since_save * self.max_overhead_percent / 100.0
        return moment.last_blocking <= budget


def _parts(cls: type, policies: tuple[Any, ...]) -> tuple[SaveRule, ...]:
    if not policies:
        raise OptionTypeError(f"{cls.__name__}() needs at least one save policy, found none")
    out: list[SaveRule] = []
    for i, p in enumerate(policies):
        p = check_rule(p, f"{cls.__name__}(...) argument {i}")
        out.extend(p.policies if type(p) is cls else (p,))  # a | b | c: one AnyOf
    return tuple(out)


@dataclass(frozen=True, init=False)
class _Combined(SaveRule):
    """What AnyOf and AllOf share: their parts (nested ones of the same kind flattened),
    and needing the time or the preemption notice when any part does."""

    policies: tuple[SaveRule, ...]

    def __init__(self, *policies: Any):
        object.__setattr__(self, "policies", _parts(type(self), policies))

    @property
    def uses_time(self) -> bool:  # type: ignore[override]
        return any(p.uses_time for p in self.policies)

    @property
    def watches_preemption(self) -> bool:  # type: ignore[override]
        return any(p.watches_preemption for p in self.policies)


@dataclass(frozen=True, init=False)
class AnyOf(_Combined):
    """Saves when any of ``policies`` wants the step (``a | b``)."""

    def wants(self, moment: Moment) -> bool:
        return any(p.wants(moment) for p in self.policies)


@dataclass(frozen=True, init=False)
class AllOf(_Combined):
    """Saves when every one of ``policies`` wants the step (``a & b``)."""

    def wants(self, moment: Moment) -> bool:
        return all(p.wants(moment) for p in self.policies)
