"""Retention as small composable objects: which committed steps a manager keeps.

Each rule is a frozen value asked :meth:`KeepRule.kept` about the committed steps
(ascending) and the :class:`StepFacts` the manager knows of them; a step survives
when any rule keeps it (``a | b`` is :class:`KeepAny`, the union). Steps not kept are
deleted by the retention runner (``retaining``), except the protected ones (the newest,
the one just written, those being read or not yet replicated).

* :class:`KeepLast` ``(n)``: the ``n`` highest steps;
* :class:`KeepEvery` ``(k)``: every step divisible by ``k``, forever;
* :class:`KeepBest` ``(n, metric=, mode=)``: the ``n`` steps with the best finite
  ``extras[metric]`` (``mode`` "min" or "max"; ties go to the newer step); a step
  without one, or whose metric is NaN or infinite (a diverged run), is never best;
* :class:`KeepFor` ``(seconds)``: the steps this manager saved less than ``seconds``
  ago (its clock, as of its latest save); a step whose save time it does not know
  (one of an earlier run) is kept: an age rule never removes what it cannot date.

``Retention(keep=, keep_every=, keep_best=, best_metric=, best_mode=)`` and the
manager's shorthands produce these same objects (``Retention.rule``).

Pure values; any thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._base.env import Option, found
from .._errors import OptionTypeError

__all__ = [
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepFor",
    "KeepLast",
    "KeepRule",
    "StepFacts",
    "check_keep",
    "finite",
]


def finite(value: object) -> float | None:
    """``value`` as a finite float; None for no metric, a non-number, NaN or +-inf."""
    if value is None:
        return None
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return out if math.isfinite(out) else None


@dataclass(frozen=True)
class StepFacts:
    """What a manager knows of its committed steps: ``metrics[name][step]`` (the saved
    extras' values), ``times[step]`` (when this manager saved it, on its clock),
    ``lanes[step]`` (the lane it was saved in: ``lanes.Lanes``), ``now`` (the time of
    the latest save, which ages are measured from; None: no save dated)."""

    metrics: Mapping[str, Mapping[int, Any]] = field(default_factory=dict)
    times: Mapping[int, float] = field(default_factory=dict)
    lanes: Mapping[int, str | None] = field(default_factory=dict)
    now: float | None = None


class KeepRule:
    """The protocol of a retention rule: :meth:`kept`, :attr:`metric_names`,
    :attr:`deletes_anything`, :attr:`uses_time`; ``a | b`` keeps what either keeps."""

    deletes_anything = True  # without it no step is ever deleted (nothing to run)
    uses_time = False  # the facts' times matter (then they are the primary's, shared)

    @property
    def metric_names(self) -> frozenset[str]:
        """The extras' keys the rule ranks (read back from a step when not known)."""
        return frozenset()

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:  # pragma: no cover
        raise NotImplementedError

    def __or__(self, other: Any) -> KeepAny:
        return KeepAny(self, other)

    def __and__(self, other: Any) -> Any:
        raise OptionTypeError(
            f"retention rules combine with | only: {self!r} | {other!r} keeps a step that "
            f"any of them keeps (& would delete a step one rule still wants)"
        )

    __rand__ = __and__


def check_keep(value: Any, where: str) -> KeepRule:
    """``value`` if it is a retention rule, else OptionTypeError naming ``where``."""
    if not isinstance(value, KeepRule):
        raise OptionTypeError(
            f"{where} must be a retention rule (fop.KeepLast(n), fop.KeepEvery(k), "
            f"fop.KeepBest(n, metric=...), fop.KeepFor(seconds), fop.KeepAny(...), "
            f"fop.Retention(...)), found {found(value)}"
        )
    return value


_LAST = Option("KeepLast(n)", "int", low=1)
_EVERY = Option("KeepEvery(k)", "int", low=1)
_BEST = Option("KeepBest(n)", "int", low=1)
_METRIC = Option("KeepBest(metric)", "str", expected="a key of the saved extras (a str)")
_MODE = Option("KeepBest(mode)", "choice", choices=("min", "max"))
_AGE = Option("KeepFor(seconds)", "number", low=0, low_open=True)


@dataclass(frozen=True)
class KeepLast(KeepRule):
    """Keeps the ``n`` (>= 1) highest steps."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _LAST.check(self.n))

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:
        return set(steps[-self.n :])


@dataclass(frozen=True)
class KeepEvery(KeepRule):
    """Keeps every step divisible by ``k`` (>= 1), forever; deletes nothing alone."""

    k: int
    deletes_anything = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", _EVERY.check(self.k))

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:
        return {s for s in steps if s % self.k == 0}


@dataclass(frozen=True)
class KeepBest(KeepRule):
    """Keeps the ``n`` (>= 1) steps with the best finite ``extras[metric]``. A NaN or
    infinite value is known and never best (a diverged step); a step without a value
    (its extras lack the metric) is left to the other rules, as a step saved between
    evaluations is. While no step holds a value at all (a misspelt ``metric``, or no
    evaluation yet) it ranks nothing and keeps every step: it cannot tell which are
    best, and deleting them would lose the ones it was asked to keep."""

    n: int
    metric: str = ""
    mode: str = "min"

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _BEST.check(self.n))
        object.__setattr__(self, "metric", _METRIC.check(self.metric))
        object.__setattr__(self, "mode", _MODE.check(self.mode))

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset({self.metric})

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:
        values = facts.metrics.get(self.metric, {})
        if not any(s in values for s in steps):  # nothing to rank by: nothing is judged
            return set(steps)
        ranked = {s: m for s in steps if (m := finite(values.get(s))) is not None}
        sign = 1.0 if self.mode == "min" else -1.0
        order = sorted(ranked, key=lambda s: (sign * ranked[s], -s))  # ties: the newer
        return set(order[: self.n])


@dataclass(frozen=True)
class KeepFor(KeepRule):
    """Keeps the steps saved less than ``seconds`` (> 0) before the latest save (and
    every step whose save time is unknown: one of an earlier run)."""

    seconds: float
    uses_time = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "seconds", _AGE.check(self.seconds))

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:
        now = facts.now
        return {
            s
            for s in steps
            if now is None or s not in facts.times or now - facts.times[s] < self.seconds
        }


@dataclass(frozen=True, init=False)
class KeepAny(KeepRule):
    """Keeps what any of ``rules`` keeps (``a | b``); deletes when one of them does."""

    rules: tuple[KeepRule, ...]

    def __init__(self, *rules: Any):
        if not rules:
            raise OptionTypeError("KeepAny() needs at least one retention rule, found none")
        out: list[KeepRule] = []
        for i, r in enumerate(rules):
            r = check_keep(r, f"KeepAny(...) argument {i}")
            out.extend(r.rules if type(r) is KeepAny else (r,))
        object.__setattr__(self, "rules", tuple(out))

    @property
    def deletes_anything(self) -> bool:  # type: ignore[override]
        return any(r.deletes_anything for r in self.rules)

    @property
    def uses_time(self) -> bool:  # type: ignore[override]
        return any(r.uses_time for r in self.rules)

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset().union(*(r.metric_names for r in self.rules))

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:
        out: set[int] = set()
        for r in self.rules:
            out |= r.kept(steps, facts)
        return out
