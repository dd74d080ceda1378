"""Retention as small composable objects: which committed steps a manager keeps; and
lanes, two save policies each with its own retention. Pure values; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.retention``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from .._base.env import Option, check, found
from .._base.keywords import refuse_without
from .._errors import OptionError, OptionTypeError
from .save_rules import Moment, SaveRule, check_rule, flattened


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
    """What a manager knows of its committed steps (``now``: the latest save's time)."""

    metrics: Mapping[str, Mapping[int, Any]] = field(default_factory=dict)
    times: Mapping[int, float] = field(default_factory=dict)
    lanes: Mapping[int, str | None] = field(default_factory=dict)
    now: float | None = None


class KeepRule:
    """The protocol of a retention rule; ``a | b`` keeps what either keeps."""

    deletes_anything = True  # without it no step is ever deleted (nothing to run)
    uses_time = False  # the facts' times matter (then they are the primary's, shared)
    _checks: Mapping[str, Option] = {}  # field -> its declaration, checked when made

    def __post_init__(self) -> None:
        for name, option in self._checks.items():
            object.__setattr__(self, name, option.check(getattr(self, name)))

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


@dataclass(frozen=True)
class KeepLast(KeepRule):
    """Keeps the ``n`` (>= 1) highest steps."""

    n: int
    _checks = {"n": Option("KeepLast(n)", "int", low=1)}

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:
        return set(steps[-self.n :])


@dataclass(frozen=True)
class KeepEvery(KeepRule):
    """Keeps every step divisible by ``k`` (>= 1), forever; deletes nothing alone."""

    k: int
    deletes_anything = False
    _checks = {"k": Option("KeepEvery(k)", "int", low=1)}

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
    _checks = {
        "n": Option("KeepBest(n)", "int", low=1),
        "metric": Option("KeepBest(metric)", "str", expected="a key of the saved extras (a str)"),
        "mode": Option("KeepBest(mode)", "choice", choices=("min", "max")),
    }

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
    _checks = {"seconds": Option("KeepFor(seconds)", "number", low=0, low_open=True)}

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
        parts = flattened(KeepAny, rules, check_keep, "retention rule", "rules")
        object.__setattr__(self, "rules", parts)

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


def _count(name: str, doc: str, aliases: tuple[str, ...] = ()) -> Option:
    words = "a positive int or None"
    return Option(name, "int", none_ok=True, low=1, expected=words, doc=doc, aliases=aliases)


KEEP = _count(
    "keep",
    "keep the last N steps (None: no limit from this rule)",
    ("max_to_keep", "keep_last", "keep_last_n", "num_to_keep"),
)
KEEP_EVERY = _count(
    "keep_every",
    "also keep every step divisible by it, forever",
    ("keep_period", "keep_every_n_steps", "keep_checkpoint_every_n_steps"),
)
KEEP_BEST = _count("keep_best", "also keep the N steps with the best extras[best_metric]")
BEST_METRIC = Option(
    "best_metric",
    "str",
    none_ok=True,
    expected="a key of the extras (a str) or None",
    doc="the key of the saved extras that keep_best ranks",
    aliases=("metric",),
)
BEST_MODE = Option(
    "best_mode",
    "choice",
    choices=("min", "max"),
    default="min",
    annotation="str",
    doc='"min" or "max": which end of best_metric is best',
    aliases=("best_mode_fn",),
)
FIELDS: tuple[Option, ...] = (KEEP, KEEP_EVERY, KEEP_BEST, BEST_METRIC, BEST_MODE)
"""The fields of :class:`Retention`, which are also the manager's shorthands."""

ALIASES: tuple[tuple[str, Callable[[Mapping[str, Any]], KeepRule]], ...] = (
    ("keep", lambda v: KeepLast(v["keep"])),
    ("keep_every", lambda v: KeepEvery(v["keep_every"])),
    ("keep_best", lambda v: KeepBest(v["keep_best"], metric=v["best_metric"], mode=v["best_mode"])),
)
"""The flat spellings of a retention -> the rule object each stands for."""


def from_aliases(values: Mapping[str, Any]) -> KeepAny:
    """The union of the rules ``values`` (checked flat fields) set; none: ``KeepEvery(1)``."""
    parts = [make(values) for name, make in ALIASES if values.get(name) is not None]
    return KeepAny(*parts) if parts else KeepAny(KeepEvery(1))


@dataclass(frozen=True)
class Retention(KeepRule):
    """What to keep; see the module docstring. Every field is optional.

    ``Retention(keep=3, keep_every=1000)``, ``Retention(keep=1, keep_best=2,
    best_metric="loss")``: checked when made (OptionError naming the field; a rule
    that does nothing, such as ``keep_every`` alone, is refused). Frozen; any thread.
    """

    _: KW_ONLY
    keep: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        values = check(FIELDS, {o.name: getattr(self, o.name) for o in FIELDS})
        for name, value in values.items():
            object.__setattr__(self, name, value)
        if (self.keep_best is None) != (self.best_metric is None):
            given = "keep_best" if self.best_metric is None else "best_metric"
            raise OptionError(
                f"{given}= needs {'best_metric' if given == 'keep_best' else 'keep_best'}=: "
                "keep_best and best_metric go together (set both or neither)"
            )
        if not self.deletes_anything:
            needs = "keep= or keep_best= (without them no step is deleted)"
            refuse_without("keep_every", self.keep_every, needs)
        if self.keep_best is None:
            needs = "keep_best= and best_metric="
            refuse_without("best_mode", self.best_mode, needs, default="min")

    @property
    def rule(self) -> KeepRule:
        """The same retention as the composable rules (``from_aliases``), which
        answers for it (the library itself is handed the rule: ``options``)."""
        return from_aliases(vars(self))

    @property
    def deletes_anything(self) -> bool:  # type: ignore[override]
        return self.rule.deletes_anything

    @property
    def metric_names(self) -> frozenset[str]:
        return self.rule.metric_names

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:
        return self.rule.kept(steps, facts)


def steps_to_delete(
    steps: Iterable[int],
    policy: KeepRule,
    *,
    metrics: Mapping[int, float] | None = None,
    protected: Iterable[int] = (),
    facts: StepFacts | None = None,
) -> list[int]:
    """The sorted steps that neither ``policy`` nor ``protected`` keeps."""
    steps = sorted(set(steps))
    if not policy.deletes_anything:
        return []
    if facts is None:
        names = policy.metric_names
        facts = StepFacts(metrics={n: dict(metrics or {}) for n in names})
    keep = set(protected) | policy.kept(steps, facts)
    return [s for s in steps if s not in keep]


def sound_steps_to_delete(
    steps: Iterable[int],
    policy: KeepRule,
    *,
    whole: Callable[[int], bool],
    protected: Iterable[int] = (),
    facts: StepFacts | None = None,
) -> list[int]:
    """:func:`steps_to_delete` where a step ``whole`` refuses is neither deleted nor kept."""
    steps, damaged = sorted(set(steps)), set()
    while True:
        sound = [s for s in steps if s not in damaged]
        doomed = steps_to_delete(sound, policy, facts=facts, protected=protected)
        bad = {s for s in sound if s not in doomed and not whole(s)}
        if not bad:
            return doomed
        damaged |= bad


TEMPORARY = "temporary"
PERMANENT = "permanent"


@dataclass(frozen=True)
class Lane:
    """One lane: the steps ``save`` wants, kept by ``keep`` (None: forever)."""

    save: SaveRule
    keep: KeepRule | None = None

    def __post_init__(self) -> None:
        check_rule(self.save, "Lane(save)")
        if self.keep is not None:
            check_keep(self.keep, "Lane(keep)")
            if not self.keep.deletes_anything:
                raise OptionError(
                    f"Lane(keep={self.keep!r}) deletes nothing (a KeepEvery keeps steps "
                    "beside a rule that deletes): add KeepLast(n) or KeepFor(seconds), or "
                    "give keep=None to keep the lane's steps forever"
                )


@dataclass(frozen=True)
class Lanes(SaveRule, KeepRule):
    """A temporary and a permanent :class:`Lane` (see the module docstring)."""

    temporary: Lane
    permanent: Lane

    def __post_init__(self) -> None:
        for name in (TEMPORARY, PERMANENT):
            value = getattr(self, name)
            if not isinstance(value, Lane):
                raise OptionError(
                    f"Lanes({name}=) must be a fop.Lane(save_policy, keep=...), found "
                    f"{type(value).__name__} {value!r}"
                )

    @property
    def uses_time(self) -> bool:  # type: ignore[override]
        keeps = [lane.keep for lane in self._lanes() if lane.keep is not None]
        return any(lane.save.uses_time for lane in self._lanes()) or any(k.uses_time for k in keeps)

    @property
    def watches_preemption(self) -> bool:  # type: ignore[override]
        return any(lane.save.watches_preemption for lane in self._lanes())

    def wants(self, moment: Moment) -> bool:
        return self.label(moment) is not None

    def label(self, moment: Moment) -> str | None:
        if self.permanent.save.wants(moment):
            return PERMANENT
        return TEMPORARY if self.temporary.save.wants(moment) else None

    uses_lanes = True  # the facts' lanes matter: each step's, recorded in its manifest

    @property
    def deletes_anything(self) -> bool:  # type: ignore[override]
        return any(lane.keep is not None for lane in self._lanes())

    @property
    def metric_names(self) -> frozenset[str]:
        keeps = [lane.keep for lane in self._lanes() if lane.keep is not None]
        return frozenset().union(*(k.metric_names for k in keeps))

    def kept(self, steps: list[int], facts: StepFacts) -> set[int]:
        lanes = {s: facts.lanes.get(s) or self._lane_by_number(s) for s in steps}
        temporary = [s for s in steps if lanes[s] == TEMPORARY]
        permanent = [s for s in steps if lanes[s] != TEMPORARY]
        out: set[int] = set()
        for lane, own in ((self.temporary, temporary), (self.permanent, permanent)):
            out |= set(own) if lane.keep is None else lane.keep.kept(own, facts)
        return out

    def _lane_by_number(self, step: int) -> str:
        """The lane of an earlier run's step: by its number if it can tell, else permanent."""
        save = self.permanent.save
        if save.uses_time or save.watches_preemption:
            return PERMANENT
        return PERMANENT if save.wants(Moment(step=step)) else TEMPORARY

    def _lanes(self) -> tuple[Lane, Lane]:
        return (self.temporary, self.permanent)

    def __or__(self, other: Any) -> Any:
        raise OptionError("a Lanes is the whole policy: combine the policies inside its lanes")
