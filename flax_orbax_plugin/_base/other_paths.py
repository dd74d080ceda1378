"""A process that took another path: its collective operation of the number this one
waits in is of another kind (seen in its heartbeat, ``_base/regions.py``), so it never
makes this call. Two processes get there when an error reached one of them at another
point than the others (it went on to close while they saved the next step, say), or
when a collective call was made on some processes only; each then waited for the
other until the stall timeout. Now the wait raises within a second or two, naming the
process and the failure it published last (``_base/regions.py``), the error that sent
it there as a rule.

Threading: the waiting thread (``coordination._wait``), handed its region.
"""

from __future__ import annotations

from typing import Any

import jax

from .._errors import CoordinationError, ProcessFailedError
from . import failures as _failures
from . import regions as _regions

__all__ = ["raise_elsewhere"]


def raise_elsewhere(region: _regions.Region | None, process: int, theirs: str, doing: str) -> None:
    """Raises for a wait in ``region`` on ``process``, whose collective operation of the
    region's number is ``theirs``, of another kind (from its heartbeat: ``liveness``):
    it took another path and never makes this call. :class:`ProcessFailedError` naming
    its latest published failure (the error that sent it there, as a rule), else
    :class:`CoordinationError` naming this process's own (the error that sent this one
    here), if any."""
    assert region is not None
    words = (
        f"process {jax.process_index()} of {jax.process_count()}, in {region.kind} "
        f"(operation {region.tag}): process {process} is in {theirs} as its operation "
        f"{region.tag}, so it will not make this call"
    )
    latest = _latest_failures()
    r = latest.get(process)
    if r is not None:
        said = f"it failed in {r['kind']}: {r['type']}: {r['message']}"
        error = ProcessFailedError(f"{words}: {said}")
        error.process, error.error_type = process, r["type"]
        raise error
    own = latest.get(jax.process_index())
    why = (
        " (a collective call made on some processes only?)"
        if own is None
        else f" (this process failed before, in {own['kind']}: {own['type']}: {own['message']})"
    )
    raise CoordinationError(f"{words}{why}; it was {doing}")


def _latest_failures() -> dict[int, dict[str, Any]]:
    """The failure each process published last (in its region of the highest number)."""
    _regions.CALLS["failure_check"] += 1
    try:
        found = _regions.client().key_value_dir_get(f"{_failures.FAILED}/")
    except Exception:  # noqa: BLE001  (none, or a service gone)
        return {}
    latest: dict[int, tuple[int, dict[str, Any]]] = {}
    for key, value in found:
        tag = key.split(f"{_failures.FAILED}/", 1)[-1].split("/", 1)[0]
        r = _failures.failure_record(value)
        if tag.isdigit() and int(tag) >= latest.get(r["process"], (-1, r))[0]:
            latest[r["process"]] = (int(tag), r)
    return {p: r for p, (_, r) in latest.items()}
