"""The plan of a restore (``dry_run=True``): which saved leaves, and which index
ranges of them, make each leaf of like; built from the restore's checked targets, so
it is what the read would do (``_like.surgery_plan.RestorePlan``).
Threading: pure; the restoring thread.
"""

from __future__ import annotations

from .._like.surgery_plan import PlanEntry, RestorePlan, full_box
from .targets import Target


def entry_of(target: Target, path: str) -> PlanEntry:
    """``target``'s entry under like's ``path``."""
    record = target.record
    if target.virtual is None:
        box = full_box(tuple(record.shape))
        return PlanEntry(path, tuple(record.shape), record.dtype, ((record.path, box),))
    node = target.virtual.node
    pieces, _ = node.pieces(full_box(node.shape))
    sources = tuple((p.record.path, p.box) for p in pieces)
    return PlanEntry(path, tuple(node.shape), node.dtype, sources, target.virtual.how)


def plan_of(
    where: str, targets: list[Target], paths: list[str], kept: list[str], saved: list[str]
) -> RestorePlan:
    """The plan of reading ``targets`` (like's ``paths``, in order; ``kept``: like's
    leaves kept as they are; ``saved``: the checkpoint's leaves holding values)."""
    entries = tuple(entry_of(t, p) for t, p in zip(targets, paths, strict=True))
    read = {path for e in entries for path, _ in e.sources}
    dropped = tuple(p for p in saved if p not in read)
    return RestorePlan(where, entries, tuple(kept), dropped)
