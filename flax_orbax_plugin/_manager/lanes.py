"""Temporary and permanent lanes: two save policies, each with its own retention.

Pure values; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.lanes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._errors import OptionError
from .retention import KeepRule, StepFacts, check_keep
from .save_rules import Moment, SaveRule, check_rule

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

    # -- the save policy

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

    # -- the retention

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
        """The lane of an earlier run's step: by its number when the permanent policy
        goes by numbers only, else permanent (never removed by the temporary rule)."""
        save = self.permanent.save
        if save.uses_time or save.watches_preemption:
            return PERMANENT
        return PERMANENT if save.wants(Moment(step=step)) else TEMPORARY

    def _lanes(self) -> tuple[Lane, Lane]:
        return (self.temporary, self.permanent)

    def __or__(self, other: Any) -> Any:
        raise OptionError("a Lanes is the whole policy: combine the policies inside its lanes")
