"""The commit rounds of several processes beside the primary's (``_core.save``): theirs,
the agreement of their statuses, and the first leaf where their trees differ.

Threading: the save's background thread, every process in the same order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .._base import distributed as _distributed
from .._errors import CoordinationError


def other_round(op, status, abort, structure, region) -> str:
    """Another process's side: its status published, the outcome read (waited for longer)."""
    region.publish(f"{op}/status", status)
    wait = 2 * region.stall_timeout()
    outcome = region.broadcast_str(f"{op}/outcome", None, timeout_s=wait)
    if STRUCTURE in outcome and structure is not None:
        mine = structure()
        region.publish(f"{op}/structure", json.dumps(mine))  # for 0
        outcome += _first_difference(op, mine, region)
    if outcome != "committed":
        outcome = discard(abort, outcome)  # e.g. staging of another step than the primary's
    return outcome


STRUCTURE = "tree of another structure"  # in the outcome when the digests differ


def disagreement(statuses: list[dict[str, Any]]) -> str | None:
    """``disagree: ...`` naming the first process whose step, options or tree differ."""
    first = statuses[0]
    for p, s in enumerate(statuses[1:], start=1):
        if s["step"] != first["step"]:
            return (
                f"disagree: process 0 saved step {first['step']} but process {p} saved step "
                f"{s['step']}; every process must save the same step"
            )
        if s["agreed"] != first["agreed"]:
            mine, theirs = first["agreed"], s["agreed"]
            names = sorted(k for k in {*mine, *theirs} if mine.get(k) != theirs.get(k))
            each = "; ".join(
                f"{k}: {mine.get(k)!r} on process 0, {theirs.get(k)!r} on process {p}"
                for k in names
            )
            return f"disagree: the processes saved with different options ({each}); " + (
                "every process must pass the same"
            )
        if s["digest"] != first["digest"]:
            return (
                f"disagree: process {p} saved a {STRUCTURE} than process 0 "
                f"(structure digests {s['digest'][:12]} and {first['digest'][:12]}) at step "
                f"{first['step']}; every process must save the same tree"
            )
    return None


def _first_difference(op: str, mine: list[str], region, p: int = 0, timeout_s=None) -> str:
    """``; ...``: the first leaf where this tree differs from process ``p``'s, or ""."""
    try:
        got = region.get_from(f"{op}/structure", p, timeout_s=timeout_s)
        theirs = json.loads(got)
    except (CoordinationError, ValueError):
        return ""
    for a, b in zip(mine, theirs, strict=False):
        if a != b:
            return f"; the first leaf that differs: {a!r} here, {b!r} on process {p}"
    if len(mine) != len(theirs):
        extra = mine[len(theirs)] if len(mine) > len(theirs) else theirs[len(mine)]
        return (
            f"; {len(mine)} leaves here, {len(theirs)} on process {p} (the first one only "
            f"{'here' if len(mine) > len(theirs) else f'on process {p}'}: {extra!r})"
        )
    return "; the leaves' paths, kinds, dtypes, shapes and small values agree: a str leaf differs"


def their_difference(op: str, outcome: str, mine: list[str], region: _distributed.Region) -> str:
    """The primary's side of :func:`_first_difference` (waits seconds at most)."""
    found = re.search(r"process ([0-9]+) saved a " + STRUCTURE, outcome)
    if found is None:
        return ""
    return _first_difference(op, mine, region, int(found.group(1)), timeout_s=10.0)


def discard(abort: Callable[[], None], outcome: str) -> str:
    """Removes this process's staged files after a failed outcome; a failure is added to it."""
    try:
        abort()
    except Exception as e:  # noqa: BLE001
        me = _distributed.process_index()
        return f"{outcome} (and removing process {me}'s staged files failed: {e})"
    return outcome


def structure_lines(leaves: list) -> list[str]:
    """One line per leaf (what the structure digest covers), to name a difference."""
    out = []
    for leaf in leaves:
        r = leaf.record
        shape = "" if r.shape is None else list(r.shape)
        shown = leaf.value_digest
        value = "" if shown is None else f" (value digest {shown})"
        out.append(f"{r.path}: {r.kind} {r.dtype or ''}{shape}{value}".rstrip())
    return out
