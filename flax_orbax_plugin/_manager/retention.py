"""Retention: which committed steps a CheckpointManager deletes.

A pure function of the step list, so it is tested without touching storage. A
step survives if any rule keeps it:

* ``keep_last``: the ``keep_last`` highest steps;
* ``keep_every``: every step divisible by ``keep_every``, forever;
* ``keep_best``: the ``keep_best`` steps with the best ``metrics[step]``
  (``mode`` "min" or "max"); only finite metrics are ranked: a step without one, or
  whose metric is NaN, +inf or -inf (a diverged run), is not best and is kept or
  deleted by the other rules alone;
* ``protected``: steps never deleted (the one just written, the newest, ones being
  read).

When neither ``keep_last`` nor ``keep_best`` is set nothing is deleted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["RetentionPolicy", "steps_to_delete"]


@dataclass(frozen=True)
class RetentionPolicy:
    """What to keep; see the module docstring. All fields optional."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self):
        for name in ("keep_last", "keep_every", "keep_best"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, found {v!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', found {self.best_mode!r}")
        if (self.keep_best is None) != (self.best_metric is None):
            raise ValueError("keep_best and best_metric go together: set both or neither")

    @property
    def deletes_anything(self) -> bool:
        return self.keep_last is not None or self.keep_best is not None


def steps_to_delete(
    steps: Iterable[int],
    policy: RetentionPolicy,
    *,
    metrics: Mapping[int, float] | None = None,
    protected: Iterable[int] = (),
) -> list[int]:
    """Return the sorted steps that ``policy`` does not keep."""
    steps = sorted(set(steps))
    if not policy.deletes_anything:
        return []
    keep = set(protected)
    if policy.keep_last is not None:
        keep.update(steps[-policy.keep_last :])
    if policy.keep_every is not None:
        keep.update(s for s in steps if s % policy.keep_every == 0)
    if policy.keep_best is not None:
        metrics = metrics or {}
        finite = {s: m for s in steps if (m := _finite(metrics.get(s))) is not None}
        ranked = list(finite)
        sign = 1.0 if policy.best_mode == "min" else -1.0
        # Ties go to the newer step.
        ranked.sort(key=lambda s: (sign * finite[s], -s))
        keep.update(ranked[: policy.keep_best])
    return [s for s in steps if s not in keep]


def _finite(value: object) -> float | None:
    """``value`` as a finite float; None for no metric, a non-number, NaN or +-inf."""
    if value is None:
        return None
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return out if math.isfinite(out) else None
