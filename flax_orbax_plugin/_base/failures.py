"""Failures seen by every process: an error leaving a collective operation's region is
published there (:func:`publish_failure`), and a wait in that region raises
:class:`ProcessFailedError` once another process published one
(:func:`raise_published_failure`), announced an agreement it brings an error to, left
the manager's scope or its program (:func:`announce_leaving`, :func:`raise_if_left`), or
took another path (:func:`raise_elsewhere`). Only several processes reach here; each
``region`` is a ``_base.distributed.Region`` (typed ``Any``: that module imports this one).

Threading: any thread; the records are this module's own JSON.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.regions``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax

from .._errors import CheckpointError, CoordinationError, ProcessFailedError
from .regions import CALLS, client, is_set

FAILED = "fop/failed"  # FAILED/<region>/<process>: a failure leaving that region
LEFT = "fop/left"  # LEFT/<scope>/<process>: it left that scope (announce_leaving)
PROGRAM = "program"  # the scope of waits outside a manager's: a process whose program ended


def announce_program_end() -> bool:
    """At exit (``_base.host``), in a process that took part in a collective operation:
    says that it left :data:`PROGRAM`, with the exception that ended it, if any."""
    ended = getattr(sys, "last_value", None) or CheckpointError("its program ended")
    announce_leaving(ended, scope=PROGRAM, where="the program")
    return False


def _set(key: str, record: dict[str, Any], *, quiet: bool = True) -> None:
    """Sets ``record`` under ``key``; a service already gone is no news to the others
    (raised only when not ``quiet``)."""
    CALLS["kv_set"] += 1
    try:
        client().key_value_set(key, json.dumps(record), allow_overwrite=True)
    except Exception:  # a service gone: the error itself is raised on this process
        if not quiet:
            raise


def publish_failure(region: Any, error: BaseException) -> None:
    """Publishes ``error`` as this process's failure in ``region`` (the last one stays)."""
    _set(f"{FAILED}/{region.tag}/{jax.process_index()}", _record(region.kind, error))


def announce_agreement(op: str, error: BaseException, region: Any) -> None:
    """Before an agreement (``distributed.agree``) this process brings ``error`` to: a
    process waiting elsewhere (which this one will never meet there) raises rather than
    waits; one at the same agreement, or past it, reads on."""
    if region.spans and jax.process_count() > 1:
        number = int(op.rsplit(".", 1)[1])
        record = {**_record(region.kind, error), "agreement": op, "number": number}
        _set(f"{FAILED}/{region.tag}/{jax.process_index()}/at/{number}", record, quiet=False)


def announce_leaving(error: BaseException, *, scope: str | None, where: str) -> None:
    """Says that this process leaves ``scope`` (a manager's operations: see the
    region's ``scope``) with ``error``, raised out of ``where``: a process waiting in
    that scope for one of its values raises within a slice (:func:`raise_if_left`), not
    at its stall timeout. A new manager is a new scope."""
    if scope is None or jax.process_count() == 1:
        return
    record = _record(where, error)
    _set(f"{LEFT}/{scope}/{jax.process_index()}", record)


def _failed(message: str, process: int, error_type: str) -> ProcessFailedError:
    error = ProcessFailedError(message)
    error.process, error.error_type = process, error_type
    return error


def _me() -> str:
    return f"process {jax.process_index()} of {jax.process_count()}"


def raise_if_left(process: int, key: str, region: Any) -> None:
    """Raises ProcessFailedError when ``process`` announced that it left the scope of
    ``region`` (outside a manager's scope, :data:`PROGRAM`) and ``key``, the value this
    wait is for, is not set: it never will be. Any thread."""
    scope = PROGRAM if region.scope is None else region.scope
    c = client()
    CALLS["failure_check"] += 1
    try:
        said = c.key_value_try_get(f"{LEFT}/{scope}/{process}")
    except Exception:  # noqa: BLE001  (NOT_FOUND: it did not leave)
        return
    if is_set(key):  # set before it left: read on
        return
    r = failure_record(said)
    where = region.kind if region.spans else "waiting"
    said = f"left {r['kind']} with {r['type']}: {r['message']}"
    raise _failed(f"{_me()}, in {where}: process {process} {said}", process, r["type"])


def _diverged(region: Any, r: dict[str, Any], waiting_for: int | None) -> bool:
    """Whether another process's record ends the waits in ``region``: a failure leaving
    the region, or an agreement the region is not at and never went through, of the
    process it waits for, or past which the region has already drawn names."""
    op = r["agreement"]
    if op is None:
        return True
    if op == region.agreeing or op in region.agreed:
        return False
    return r["process"] == waiting_for or r["number"] < region.drawn


def _record(kind: str, error: BaseException) -> dict[str, Any]:
    return {
        "process": jax.process_index(),
        "kind": kind,
        "type": type(error).__name__,
        "message": str(error)[:4000],
        "derived": isinstance(error, ProcessFailedError),
        "agreement": None,
        "number": -1,
    }


def raise_published_failure(region: Any, waiting_for: int | None = None) -> None:
    """Raises ProcessFailedError when another process published a failure in ``region``
    (an own failure first, before one only learnt); ``waiting_for``: the process whose
    value the wait is for."""
    if not region.spans or jax.process_count() == 1:
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
        said = f"failed in {r['kind']}: {r['type']}: {r['message']}"
        raise _failed(
            f"{_me()}, in {region.kind}: process {r['process']} {said}", r["process"], r["type"]
        )


def raise_elsewhere(region: Any, process: int, theirs: str, doing: str) -> None:
    """Raises for a wait in ``region`` on ``process``, whose collective operation of the
    region's number is ``theirs``, of another kind (its heartbeat: ``liveness``): it
    took another path and never makes this call. ProcessFailedError naming its latest
    published failure, else CoordinationError naming this process's own, if any."""
    words = (
        f"{_me()}, in {region.kind} (operation {region.tag}): process {process} is in "
        f"{theirs} as its operation {region.tag}, so it will not make this call"
    )
    latest = _latest_failures()
    r = latest.get(process)
    if r is not None:
        said = f"it failed in {r['kind']}: {r['type']}: {r['message']}"
        raise _failed(f"{words}: {said}", process, r["type"])
    own = latest.get(jax.process_index())
    why = (
        " (a collective call made on some processes only?)"
        if own is None
        else f" (this process failed before, in {own['kind']}: {own['type']}: {own['message']})"
    )
    raise CoordinationError(f"{words}{why}; it was {doing}")


def _latest_failures() -> dict[int, dict[str, Any]]:
    """The failure each process published last (in its region of the highest number)."""
    CALLS["failure_check"] += 1
    try:
        found = client().key_value_dir_get(f"{FAILED}/")
    except Exception:  # noqa: BLE001  (none, or a service gone)
        return {}
    latest: dict[int, tuple[int, dict[str, Any]]] = {}
    for key, value in found:
        tag = key.split(f"{FAILED}/", 1)[-1].split("/", 1)[0]
        r = failure_record(value)
        if tag.isdigit() and int(tag) >= latest.get(r["process"], (-1, r))[0]:
            latest[r["process"]] = (int(tag), r)
    return {p: r for p, (_, r) in latest.items()}


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
