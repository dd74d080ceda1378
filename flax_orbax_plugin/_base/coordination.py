"""The coordination service's key-value rounds between processes (a barrier, a
broadcast, publish and gather, a poll), each through the one wait (:func:`_wait`). Only
several processes reach here; ``_base/distributed.py`` names the rounds to callers.

Threading: every process calls the same rounds in the same order (SPMD); each takes
``region=`` explicitly; a background phase runs in the region handed to it.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.distributed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from .._errors import CoordinationError
from . import env as _env
from . import failures as _failures
from . import host as _host
from . import liveness as _liveness
from .failures import raise_published_failure
from .host import is_primary, process_count, process_index
from .regions import CALLS, Region, is_set
from .regions import client as _client

DEFAULT_TIMEOUT_S = _env.read("FOP_COORDINATION_TIMEOUT_S")  # the default stall timeout
POLL_S = 0.25  # the longest slice of a wait in a region between looks at its failures


def stall_timeout(explicit: float | None = None, *, region: Region | None) -> float:
    """The stall timeout of a wait in ``region``: ``explicit`` if given, else the
    region's (a manager's ``stall_timeout=``), else ``FOP_COORDINATION_TIMEOUT_S``."""
    if explicit is not None:
        return explicit
    found = None if region is None else region.stall_s
    return DEFAULT_TIMEOUT_S if found is None else found


def _timed_out(e: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e)


def _wait(
    key: str,
    timeout: float,
    describe: Callable[[str], str],
    process: int,
    *,
    region: Region | None,
    late: Callable[[], list[int]] | None = None,
) -> str:
    """The value under ``key`` once ``process`` set it: the one wait on other processes,
    in slices of at most :data:`POLL_S`, looking between them at the failures published
    in ``region`` and at ``process``'s heartbeat (:class:`liveness.PeerWatch`, which
    logs the ``late()`` processes and raises for a dead or stalled one)."""
    client, me = _client(), process_index()
    _liveness.ensure_beating(client, me)
    watch = _liveness.PeerWatch(
        client,
        me,
        f"{key!r} from process {process}",
        stall_s=timeout,
        late=late or (lambda: [process]),
        region=region,
    )
    piece = 0.02
    with _host.ACTIVITIES.doing(f"waiting for {key!r} from process {process}"):
        while True:
            try:
                return client.blocking_key_value_get(key, max(1, int(piece * 1000)))
            except Exception as e:  # the client raises XlaRuntimeError / JaxRuntimeError
                if not _timed_out(e):
                    raise CoordinationError(describe(str(e))) from e
            raise_published_failure(region, process)
            _failures.raise_if_left(process, key, region)
            watch.look(process)
            piece = min(2 * piece, POLL_S)


def barrier(name: str, *, region: Region | None, timeout_s: float | None = None) -> None:
    """Blocks until every process reached ``name`` (a key-value barrier); raises
    CoordinationError naming the missing processes."""
    if process_count() == 1:
        return
    timeout = stall_timeout(timeout_s, region=region)
    CALLS["barrier"] += 1
    fault_point(region)
    client, me = _client(), process_index()
    client.key_value_set(f"{name}/at/{me}", "1")

    def late() -> list[int]:
        return [p for p in range(process_count()) if p != me and not is_set(f"{name}/at/{p}")]

    def describe(said: str) -> str:
        return (
            f"process {me} of {process_count()}: not every process reached barrier {name!r} "
            f"(missing process(es): {', '.join(map(str, late()))}; {said})"
        )

    for p in range(process_count()):
        if p != me:
            _wait(f"{name}/at/{p}", timeout, describe, p, region=region, late=late)


def broadcast_str(
    name: str, value: str | None, *, region: Region | None, timeout_s: float | None = None
) -> str:
    """The primary's ``value`` on every process (others pass anything)."""
    if process_count() == 1:
        assert value is not None
        return value
    timeout = stall_timeout(timeout_s, region=region)
    fault_point(region)
    if is_primary():
        CALLS["kv_set"] += 1
        _client().key_value_set(name, value)
        return value
    CALLS["kv_get"] += 1
    return _wait(
        name,
        timeout,
        lambda e: f"process {process_index()}: no value for {name!r} from the primary ({e})",
        0,
        region=region,
    )


def publish(name: str, value: str, *, region: Region | None) -> None:
    """Stores this process's ``value`` under ``name/<process>`` for :func:`gather_str`
    (``region``: the operation's, whose fault point it is)."""
    if process_count() > 1:
        fault_point(region)
        CALLS["kv_set"] += 1
        _client().key_value_set(f"{name}/{process_index()}", value)


def forget(name: str) -> None:
    """Deletes this process's value under ``name/<process>`` once every process read it
    (errors ignored: a value left behind costs memory only)."""
    if process_count() > 1:
        CALLS["kv_delete"] += 1
        with contextlib.suppress(Exception):
            _client().key_value_delete(f"{name}/{process_index()}")


def gather_str(name: str, *, region: Region | None, timeout_s: float | None = None) -> list[str]:
    """Values that every process published under ``name``, by process index."""
    return [get_from(name, p, region=region, timeout_s=timeout_s) for p in range(process_count())]


def poll(name: str, *, region: Region | None, wait_s: float) -> str | None:
    """The value under ``name``, waiting at most ``wait_s``; None when none was set by
    then (a background thread's short polls, responsive to its own shutdown)."""
    fault_point(region)
    CALLS["kv_get"] += 1
    try:
        return _client().blocking_key_value_get(name, max(1, int(wait_s * 1000)))
    except Exception as e:
        if _timed_out(e):
            raise_published_failure(region)
            return None
        raise CoordinationError(f"process {process_index()}: reading {name!r}: {e}") from e


def get_from(
    name: str, process: int, *, region: Region | None, timeout_s: float | None = None
) -> str:
    """The value ``process`` published under ``name`` (see :func:`publish`)."""
    timeout = stall_timeout(timeout_s, region=region)
    fault_point(region)
    CALLS["kv_get"] += 1
    return _wait(
        f"{name}/{process}",
        timeout,
        lambda e: f"no value {name!r} from process {process} ({e})",
        process,
        region=region,
    )


def fault_point(region: Region | None) -> None:
    """Before each coordination call: the fault point of ``region``'s kind
    (``FOP_FAIL_AT=collective-<kind>[:N]``, see ``_base.env``; None: none)."""
    if region is not None:
        _env.fail_point(f"collective-{region.kind}")
