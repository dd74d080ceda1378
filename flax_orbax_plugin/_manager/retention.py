"""Retention: which committed steps a CheckpointManager deletes (a public option object).

:func:`steps_to_delete` is a pure function of the step list, so it is tested without
touching storage. A step survives if any rule of :class:`Retention` keeps it:

* ``keep``: the ``keep`` highest steps;
* ``keep_every``: every step divisible by ``keep_every``, forever;
* ``keep_best``: the ``keep_best`` steps with the best ``metrics[step]``
  (``best_mode`` "min" or "max"); only finite metrics are ranked: a step without one,
  or whose metric is NaN, +inf or -inf (a diverged run), is not best and is kept or
  deleted by the other rules alone;
* ``protected``: steps never deleted (the one just written, the newest, ones being
  read).

When neither ``keep`` nor ``keep_best`` is set nothing is deleted. Each field is
declared once (:data:`FIELDS`); the manager's shorthands (``keep=``, ``keep_every=``,
``keep_best=``, ``best_metric=``, ``best_mode=``) are the same declarations. A
Retention is the union of the composable rules of ``keep_rules`` (:attr:`Retention.rule`:
``KeepLast | KeepEvery | KeepBest``), which ``retention=`` takes as well (with
``KeepFor`` and ``lanes.Lanes``): :func:`steps_to_delete` asks any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass

from .._base.env import Option, check, refuse_without
from .._errors import OptionError
from .keep_rules import KeepAny, KeepBest, KeepEvery, KeepLast, KeepRule, StepFacts

__all__ = ["FIELDS", "Retention", "steps_to_delete"]


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
            refuse_without(
                "keep_every",
                self.keep_every,
                "keep= or keep_best= (without them no step is deleted)",
            )
        if self.keep_best is None:
            refuse_without(
                "best_mode", self.best_mode, "keep_best= and best_metric=", default="min"
            )

    @property
    def deletes_anything(self) -> bool:  # type: ignore[override]
        """Whether any step is ever deleted (``keep`` or ``keep_best`` set)."""
        return self.keep is not None or self.keep_best is not None

    @property
    def rule(self) -> KeepRule:
        """The same retention as the composable rules (``keep_rules``)."""
        parts: list[KeepRule] = []
        if self.keep is not None:
            parts.append(KeepLast(self.keep))
        if self.keep_every is not None:
            parts.append(KeepEvery(self.keep_every))
        if self.keep_best is not None:
            parts.append(KeepBest(self.keep_best, metric=self.best_metric, mode=self.best_mode))
        return KeepAny(*parts) if parts else KeepAny(KeepEvery(1))  # keeps every step

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset() if self.best_metric is None else frozenset({self.best_metric})

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
    """Return the sorted steps that ``policy`` (any retention rule) does not keep (nor
    ``protected``). ``facts``: what is known of the steps; ``metrics`` (``{step: value}``)
    stands for the facts of a policy that ranks one metric."""
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
    """:func:`steps_to_delete` counting only the steps ``whole(step)`` accepts (its
    manifest reads whole): a damaged step is never deleted and never counted as kept,
    so ``keep=2`` over two damaged newest steps keeps two good ones as well. ``whole``
    is asked only about steps the policy would keep."""
    steps, damaged = sorted(set(steps)), set()
    while True:
        sound = [s for s in steps if s not in damaged]
        doomed = steps_to_delete(sound, policy, facts=facts, protected=protected)
        bad = {s for s in sound if s not in doomed and not whole(s)}
        if not bad:
            return doomed
        damaged |= bad
