"""Save policies as small composable objects: which steps a CheckpointManager saves;
the preemption notice, how a writer learns at which step the run must stop.

The rules and SavePolicy are pure values (any thread). SaveSchedule and Preemption: the
training thread only; with several processes every process asks for every step, in
order, with the same step numbers (``should_save`` or ``save`` once per step).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.save_rules``.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from .._base import distributed as _distributed
from .._base.env import Option, check, found
from .._base.keywords import refuse_without
from .._errors import OptionError, OptionTypeError

MAX_SECONDS = 1e9  # seconds: about 31 years, below threading.TIMEOUT_MAX everywhere


@dataclass(frozen=True)
class Moment:
    """What a save policy is asked about ``step`` at ``now``."""

    step: int
    now: float = 0.0
    since_save: float = 0.0
    has_steps: bool = False
    in_flight: bool = False
    preempted: bool = False
    last_blocking: float | None = None


class SaveRule:
    """The protocol of a save policy; ``|`` and ``&`` combine two policies."""

    uses_time = False  # the decision depends on the time or the save in flight
    watches_preemption = False  # the manager must learn of preemption notices
    _checks: Mapping[str, Option] = {}  # field -> its declaration, checked when made

    def __post_init__(self) -> None:
        for name, option in self._checks.items():
            object.__setattr__(self, name, option.check(getattr(self, name)))

    def wants(self, moment: Moment) -> bool:  # pragma: no cover - the protocol
        raise NotImplementedError

    def label(self, moment: Moment) -> str | None:
        """The lane ``moment``'s step is saved in (``"save"`` outside lanes), or None."""
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


@dataclass(frozen=True)
class EverySteps(SaveRule):
    """Saves when ``step % n == 0`` (``n`` >= 1; ``EverySteps(1)``: every step)."""

    n: int
    _checks = {"n": Option("EverySteps(n)", "int", low=1)}

    def wants(self, moment: Moment) -> bool:
        return moment.step % self.n == 0


@dataclass(frozen=True)
class EverySeconds(SaveRule):
    """Saves when ``seconds`` (> 0) passed since the last save (or the first decision)."""

    seconds: float
    uses_time = True
    _checks = {
        "seconds": Option("EverySeconds(seconds)", "number", low=0, low_open=True, high=MAX_SECONDS)
    }

    def wants(self, moment: Moment) -> bool:
        return moment.since_save >= self.seconds


MAX_LISTED_STEPS = 1_000_000  # steps named one by one; more: a range, or every_steps


def step_set(steps: Any, where: str) -> frozenset | range:
    """The steps a rule saves, checked: a ``range`` stays one, any other a frozenset."""
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
    _checks = {
        "max_overhead_percent": Option(
            "Continuous(max_overhead_percent)", "number", low=0, low_open=True, high=100
        )
    }

    def wants(self, moment: Moment) -> bool:
        if moment.in_flight:
            return False
        if moment.last_blocking is None:
            return True
        budget = moment.since_save * self.max_overhead_percent / 100.0
        return moment.last_blocking <= budget


def flattened(cls: type, parts: tuple[Any, ...], check: Any, what: str, attr: str) -> tuple:
    """``cls``'s ``parts``, each checked, nested ones flattened: ``a | b | c`` is one AnyOf."""
    if not parts:
        raise OptionTypeError(f"{cls.__name__}() needs at least one {what}, found none")
    out: list = []
    for i, p in enumerate(parts):
        p = check(p, f"{cls.__name__}(...) argument {i}")
        out.extend(getattr(p, attr) if type(p) is cls else (p,))
    return tuple(out)


@dataclass(frozen=True, init=False)
class _Combined(SaveRule):
    """AnyOf's and AllOf's parts (nested ones of the same kind flattened)."""

    policies: tuple[SaveRule, ...]

    def __init__(self, *policies: Any):
        parts = flattened(type(self), policies, check_rule, "save policy", "policies")
        object.__setattr__(self, "policies", parts)

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

ALIASES = (("steps", AtSteps), ("every_steps", EverySteps), ("every_seconds", EverySeconds))
"""The flat spellings of a save policy -> the rule object each stands for."""


def from_aliases(values: Mapping[str, Any]) -> SaveRule:
    """The union of the rules ``values`` (checked flat fields) set; none: ``EverySteps(1)``."""
    parts = [make(values[name]) for name, make in ALIASES if values.get(name) is not None]
    if not parts:
        return EverySteps(1)
    return parts[0] if len(parts) == 1 else AnyOf(*parts)


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
    def rule(self) -> SaveRule:
        """The same policy as the composable objects (``from_aliases``), which
        answers for it (the library itself is handed the rule: ``options``)."""
        return from_aliases(vars(self))

    @property
    def uses_time(self) -> bool:  # type: ignore[override]
        return self.rule.uses_time

    def wants(self, moment: Moment | int, *, elapsed: float = 0.0) -> bool:  # type: ignore[override]
        """Whether the step of ``moment`` is to be saved; ``wants(step, elapsed=s)``:
        ``s`` seconds after the last save (or the first decision, before any save)."""
        if not isinstance(moment, Moment):
            moment = Moment(int(moment), since_save=elapsed)
        return self.rule.wants(moment)


def _sync_manager_available() -> bool:
    from jax._src.distributed import global_state  # private: read when called, not at import

    return global_state.client is not None and global_state.preemption_sync_manager is not None


class Preemption:
    """Whether, and at which step, this run was asked to stop: :meth:`install` (main
    thread), then :meth:`reached` once per step (training thread)."""

    def __init__(self, mode: str):
        self.mode = mode  # "signal" or "jax"
        self.notified = False  # signal: SIGTERM arrived; jax: the agreed step came
        self._asked: int | None = None  # the step asked last, and its answer
        self._answer = False
        self._previous: Any = None
        self._installed = False

    @classmethod
    def install(cls) -> Preemption:
        """Chooses and installs this process's way (every process calls it: the same way)."""
        if _distributed.process_count() > 1:
            if _sync_manager_available():
                return cls("jax")
            raise ValueError(
                f"handle_sigterm=True with {_distributed.process_count()} processes needs "
                "jax's preemption service, which is off (jax_enable_preemption_service=False): "
                "leave it on, or pass handle_sigterm=False and handle preemption yourself"
            )
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("handle_sigterm=True must be set from the main thread")
        self = cls("signal")
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        return self

    def _on_sigterm(self, signum, frame) -> None:
        self.notified = True

    def reached(self, step: int) -> bool:
        """True when ``step`` is the step to save before stopping. ``jax`` way: asks
        jax once per new step (every process, every step, in order)."""
        if self.mode == "signal":
            return self.notified
        if step == self._asked:
            return self._answer
        from jax.experimental import multihost_utils  # here: only a process that is asked

        self._asked = step
        self._answer = bool(multihost_utils.reached_preemption_sync_point(step))
        self.notified = self.notified or self._answer
        return self._answer

    def uninstall(self) -> None:
        """Puts back the previous SIGTERM handler (main thread only). Idempotent."""
        if not self._installed:
            return
        try:
            signal.signal(signal.SIGTERM, self._previous)
        except ValueError:  # not on the main thread
            return
        self._installed = False


FORCED = "forced"  # the label of a step saved whatever the policy says


class SaveSchedule:
    """``policy`` on its ``clock``, the last save, the notice; ``shares_time``: the decision
    is the primary's anyway; ``context()``: ``(has_steps, in_flight)``."""

    def __init__(
        self,
        policy: SaveRule,
        clock: Callable[[], float] = time.monotonic,
        shares_time: bool = False,
        context: Callable[[], tuple[bool, bool]] = lambda: (False, False),
    ):
        self._rule = policy
        self.clock = clock
        self._shares = policy.uses_time or shares_time
        self._last_time: float | None = None  # the last save's (or the first decision's)
        self._last_blocking: float | None = None
        self._saved_any = False  # this schedule recorded a save
        self._preemption_saved = False  # OnPreemption saves the agreed step once
        self.preemption_step: int | None = None  # the step saved for it (replicated)
        self.context = context
        self.preemption: Preemption | None = None
        self.stops = False  # handle_sigterm: the preemption step's save ends the run

    def watch(self, *, handle_sigterm: bool) -> None:
        """A writer's open (main thread): the preemption notice, if needed."""
        if handle_sigterm or self._rule.watches_preemption:
            self.preemption = Preemption.install()
            self.stops = handle_sigterm

    def uninstall(self) -> None:
        if self.preemption is not None:
            self.preemption.uninstall()

    def resume_clock(self, saved_at: Callable[[], float | None]) -> None:
        """A writer's open: a time rule counts from the latest step's save (``saved_at()``)."""
        if self._rule.uses_time and self.clock is time.monotonic and self._last_time is None:
            when = saved_at()
            if when is not None:
                self._last_time = self.clock() - max(0.0, time.time() - when)

    def now(self, t: float | None) -> float:
        return self.clock() if t is None else float(t)

    def _moment(self, step: int, t: float | None) -> Moment:
        now = self.now(t)
        if self._last_time is None:
            self._last_time = now  # the first decision starts the clock
        has_steps, in_flight = self.context()
        return Moment(
            step,
            now=now,
            since_save=now - self._last_time,
            has_steps=has_steps or self._saved_any,  # a save in flight counts
            in_flight=in_flight,
            preempted=self.preempted_at(step) and not self._preemption_saved,
            last_blocking=self._last_blocking,
        )

    @property
    def preempted(self) -> bool:
        return self.preemption is not None and self.preemption.notified

    def preempted_at(self, step: int) -> bool:
        """Whether ``step`` is to be saved before stopping (every step, in order)."""
        return self.preemption is not None and self.preemption.reached(step)

    def should_save(self, step: int, t: float | None) -> bool:
        if self.stops and self.preempted_at(step):
            return True
        return self._rule.label(self._moment(step, t)) is not None

    def decide(
        self, step: int, t: float | None, *, forced: bool = False, region: _distributed.Region
    ) -> tuple[str | None, float]:
        """``(label, now)``: the lane ``step`` is saved in or None, and the decision's time."""
        moment = self._moment(step, t)
        label = self._rule.label(moment)
        if forced and label is None:
            label = FORCED
        now = moment.now
        if self._shares and _distributed.process_count() > 1:
            op = region.next_operation_id("manager-policy")
            text = region.broadcast_str(op, f"{label or ''}|{now!r}")
            shared, _, when = text.partition("|")
            label, now = shared or None, float(when)
        if label is not None and moment.preempted:
            self._preemption_saved, self.preemption_step = True, step
        return label, now

    def record_save(self, now: float | None, blocking: float | None = None) -> None:
        """A save began at ``now`` (None: the clock's) and blocked ``blocking`` seconds."""
        self._last_time = self.now(now)
        self._last_blocking, self._saved_any = blocking, True
