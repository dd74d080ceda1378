"""Failures seen by every process: an error leaving a collective operation's region is
published there (:func:`publish_failure`), and a wait in that region raises
:class:`ProcessFailedError` once another process published one
(:func:`raise_published_failure`), announced an agreement it brings an error to, or left
the manager's scope or its program (:func:`announce_leaving`, :func:`raise_if_left`).
Only several processes reach here: with one, an error is simply raised.

Threading: any thread; the records are this module's own JSON.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.regions``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import jax

from .._errors import CheckpointError, ProcessFailedError
from .regions import CALLS, Region, client

__all__ = [
    "FAILED",
    "LEFT",
    "PROGRAM",
    "announce_agreement",
    "announce_leaving",
    "announce_program_end",
    "failure_record",
    "publish_failure",
    "raise_if_left",
    "raise_published_failure",
]

FAILED = "fop/failed"  # FAILED/<region>/<process>: a failure leaving that region
LEFT = "fop/left"  # LEFT/<scope>/<process>: it left that scope (announce_leaving)
PROGRAM = "program"  # the scope of waits outside a manager's: a process whose program ended


def announce_program_end() -> bool:
    """At exit (``_base.host``, once the saves still running ended), in a process that
    took part in a collective operation: says that it left :data:`PROGRAM`, with the
    exception that ended it (if one did). A wait for one of its values that it set
    before goes on (:func:`raise_if_left`): a run that ended well is not affected."""
    ended = getattr(sys, "last_value", None) or CheckpointError("its program ended")
    announce_leaving(ended, scope=PROGRAM, where="the program")
    return False


def publish_failure(region: Region, error: BaseException) -> None:
    """Publishes ``error`` as this process's failure in ``region`` (once more with a
    later error: the last one stays). A service already gone is no news to the others."""
    record = _record(region, error)
    CALLS["kv_set"] += 1
    key = f"{FAILED}/{region.tag}/{jax.process_index()}"
    try:
        client().key_value_set(key, json.dumps(record), allow_overwrite=True)
    except Exception:  # noqa: BLE001  (the error itself is raised on this process)
        pass


def announce_agreement(op: str, error: BaseException, region: Region | None) -> None:
    """Before an agreement (``distributed.agree``) at which this process brings
    ``error``: says so in the region, so that a process waiting elsewhere, which this
    one will never meet there (it left the path where the others wait), raises rather
    than waits; one at the same agreement, or past it, reads on (a recoverable failure:
    the others learn it at the agreement)."""
    if region is not None and jax.process_count() > 1:
        number = int(op.rsplit(".", 1)[1])
        record = {**_record(region, error), "agreement": op, "number": number}
        CALLS["kv_set"] += 1
        key = f"{FAILED}/{region.tag}/{jax.process_index()}/at/{number}"
        client().key_value_set(key, json.dumps(record), allow_overwrite=True)


def announce_leaving(error: BaseException, *, scope: str | None, where: str) -> None:
    """Says that this process leaves ``scope`` (a manager's operations: see
    :class:`Region`) with ``error``, raised out of ``where`` (e.g. the manager's ``with``
    block) once its own save in flight ended: it sets no more values there, so another
    process waiting in that scope for one of its values raises
    :class:`ProcessFailedError` within a slice (:func:`raise_if_left`) rather than at
    its stall timeout. A new manager is a new scope: a run that goes on after an error
    every process shared (and left together) is not affected."""
    if scope is None or jax.process_count() == 1:
        return
    record = {**_record(Region(where, scope), error), "kind": where}
    CALLS["kv_set"] += 1
    with contextlib.suppress(Exception):  # a service gone: the others learn of it anyway
        key = f"{LEFT}/{scope}/{jax.process_index()}"
        client().key_value_set(key, json.dumps(record), allow_overwrite=True)


def raise_if_left(process: int, key: str, region: Region | None) -> None:
    """Raises :class:`ProcessFailedError` when ``process`` announced that it left the
    scope of ``region``, the waiting operation's (:func:`announce_leaving`; outside a
    manager's scope, :data:`PROGRAM`: its program ended) and ``key``, its value this
    wait is for, is not set: it never will be. Any thread."""
    scope = PROGRAM if region is None or region.scope is None else region.scope
    c = client()
    CALLS["failure_check"] += 1
    try:
        said = c.key_value_try_get(f"{LEFT}/{scope}/{process}")
    except Exception:  # noqa: BLE001  (NOT_FOUND: it did not leave)
        return
    try:
        c.key_value_try_get(key)  # set before it left: read on
        return
    except Exception:  # noqa: BLE001
        pass
    r = failure_record(said)
    where = "waiting" if region is None else region.kind
    error = ProcessFailedError(
        f"process {jax.process_index()} of {jax.process_count()}, in {where}: "
        f"process {process} left {r['kind']} with {r['type']}: {r['message']}"
    )
    error.process, error.error_type = process, r["type"]
    raise error


def _diverged(region: Region, r: dict[str, Any], waiting_for: int | None) -> bool:
    """Whether a published record of another process ends the waits in ``region``: a
    failure leaving the region, or an agreement the region is not at and never went
    through, of the process it waits for (which waits there instead), or past which the
    region has already drawn names."""
    op = r["agreement"]
    if op is None:
        return True
    if op == region.agreeing or op in region.agreed:
        return False
    return r["process"] == waiting_for or r["number"] < region.drawn


def _record(region: Region, error: BaseException) -> dict[str, Any]:
    return {
        "process": jax.process_index(),
        "kind": region.kind,
        "type": type(error).__name__,
        "message": str(error)[:4000],
        "derived": isinstance(error, ProcessFailedError),
        "agreement": None,
        "number": -1,
    }


def raise_published_failure(region: Region | None, waiting_for: int | None = None) -> None:
    """Raises :class:`ProcessFailedError` when another process published a failure in
    ``region``, the waiting operation's (an own failure first, before one that was only
    learnt; None: nothing); ``waiting_for``: the process whose value it waits for."""
    if region is None or jax.process_count() == 1:
        return
    CALLS["failure_check"] += 1
    try:
        found = client().key_value_dir_get(f"{FAILED}/{region.tag}/")
    except Exception:  # noqa: BLE001  (a service gone: the wait itself reports it)
        return
    records = [failure_record(value) for _, value in found]
    me = jax.process_index()
    records = [r for r in records if r["process"] != me and _diverged(region, r, waiting_for)]
    if records:
        r = min(records, key=lambda r: (r["derived"], r["process"]))
        error = ProcessFailedError(
            f"process {jax.process_index()} of {jax.process_count()}, in {region.kind}: "
            f"process {r['process']} failed in {r['kind']}: {r['type']}: {r['message']}"
        )
        error.process, error.error_type = r["process"], r["type"]
        raise error


def failure_record(text: str) -> dict[str, Any]:
    """A published failure (this module's own JSON), every field present."""
    try:
        raw = json.loads(text)
        return {
            "process": int(raw["process"]),
            "kind": str(raw["kind"]),
            "type": str(raw["type"]),
            "message": str(raw["message"]),
            "derived": bool(raw["derived"]),
            "agreement": None if raw.get("agreement") is None else str(raw["agreement"]),
            "number": int(raw.get("number", -1)),
        }
    except (ValueError, KeyError, TypeError):
        return {
            **{"process": -1, "kind": "?", "type": "?", "message": text[:4000]},
            **{"derived": False, "agreement": None, "number": -1},
        }
