"""Which entries of an Orbax manager directory are its steps, as Orbax decides; safe
from any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._interop.orbax_steps``.
"""

from __future__ import annotations

import dataclasses
import logging

from .._base import distributed as _distributed
from .._base import shown as _shown
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .._format.foreign import OURS, TMP_MARK, not_finalized, numbered_children, subdir
from .._storage.location import Location

__all__ = ["OrbaxSteps", "agreed_latest", "list_steps"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OrbaxSteps:
    """The finalized steps of one Orbax manager directory, and what was passed over."""

    location: Location
    steps: dict[int, Location]  # step -> its directory, in ascending order
    skipped: tuple[tuple[str, str], ...] = ()  # (entry name, why it is no step)

    def skipped_above(self, step: int | None) -> list[str]:
        """``"name (why)"`` of the skipped entries above ``step`` (None: all)."""
        out = []
        for name, why in self.skipped:
            number = _number(name)
            if step is None or number is None or number > step:
                out.append(f"{name!r} ({why})")
        return out

    def choose(self, step: int | None) -> int:
        """``step`` (None: the latest), or a CheckpointNotFoundError naming what was found."""
        if not self.steps:
            passed = self.skipped_above(None)
            raise CheckpointNotFoundError(
                f"{self.location}: not an Orbax checkpoint (no finalized steps, no items)"
                + (f"; passed over: {_shown.listed(passed)}" if passed else "")
            )
        if step is None:
            latest = max(self.steps)
            passed = self.skipped_above(latest)
            if passed:
                logger.warning(
                    "%s: reading Orbax step %d, the latest finalized one; passed over "
                    "entries named like newer steps: %s",
                    self.location,
                    latest,
                    _shown.listed(passed),
                )
            return latest
        if step not in self.steps:
            why = [f"{n!r} is {w}" for n, w in self.skipped if _number(n) == step]
            raise CheckpointNotFoundError(
                f"{self.location}: no finalized Orbax step {step}"
                + (f" ({_shown.listed(why)})" if why else "")
                + f"; steps: {_shown.listed(sorted(self.steps), empty='none')}"
            )
        return step


def _number(name: str) -> int | None:
    """The step an entry's name claims (an unfinished save's too), else None."""
    head = name.split(TMP_MARK, 1)[0]
    digits = head[len(head.rstrip("0123456789")) :]
    return int(digits) if digits else None


def list_steps(loc: Location) -> OrbaxSteps:
    """Lists ``loc`` as Orbax would; CorruptCheckpointError where two directories name one
    step or two naming schemes are used (nothing is guessed)."""
    found: dict[int, tuple[str, Location]] = {}
    prefixes: dict[str, str] = {}
    skipped = []
    ours = []
    for step, prefix, name in sorted(numbered_children(loc)):
        child = subdir(loc, name, "step")
        why = "a file, not a directory" if child is None else not_finalized(child)
        if why == OURS:
            ours.append(name)
        if why is not None:
            skipped.append((name, why))
            continue
        if step in found:
            raise CorruptCheckpointError(
                f"{loc}: Orbax step {step} appears twice ({found[step][0]!r} and {name!r}); "
                f"read one of them by its own path"
            )
        found[step] = (name, child)
        prefixes.setdefault(prefix, name)
    if ours:  # never one run's steps beside another's
        raise CheckpointNotFoundError(
            f"{loc}: not an Orbax run: it holds steps of this library ({_shown.listed(ours)}); "
            f"restore those with fop.CheckpointManager, or name one Orbax step by its path"
        )
    if len(prefixes) > 1:
        examples = _shown.listed(prefixes.values(), fmt=repr)
        raise CorruptCheckpointError(
            f"{loc}: finalized Orbax steps named in {len(prefixes)} ways ({examples}): "
            f"expected one step_prefix; read a step by its own path"
        )
    skipped += [(n, "an unfinished Orbax save") for n in loc.list_children() if TMP_MARK in n]
    return OrbaxSteps(loc, {s: found[s][1] for s in sorted(found)}, tuple(skipped))


def agreed_latest(loc: Location, *, region: _distributed.Region) -> int | None:
    """Collective (every process, in the read's ``region``): the primary's latest
    finalized step, so no two processes read different steps; None if it found none."""
    op = region.next_operation_id("orbax-latest-step")
    latest = ""
    if _distributed.is_primary():
        try:
            latest = str(max(list_steps(loc).steps, default=""))
        except CheckpointError:
            pass  # raised by every process's own listing next, never left to a timeout
    agreed = region.broadcast_str(op, latest)
    return int(agreed) if agreed else None
