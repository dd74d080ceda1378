"""Multi-process coordination through jax.distributed's coordination service.

One process: every function is a no-op. Several: every process calls the same functions
in the same order (SPMD); process 0 is the primary. Every function that draws a name or
waits takes ``region=`` explicitly; a background phase runs in the region handed to it.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.distributed``.
"""

from __future__ import annotations

import functools
import itertools
import json
import secrets
import threading
from collections.abc import Callable
from typing import Any

import jax

from .. import _errors
from .._errors import CheckpointError, CoordinationError, ProcessFailedError
from . import env as _env
from . import other_paths as _other_paths
from . import regions as _regions
from .regions import Region, raise_published_failure
from .regions import client as _client

# The regions of collective operations (see the module docstring), for the callers.
collective, resumed = _regions.collective, _regions.resumed
collective_method, public = _regions.collective_method, _regions.public
publish_failure, failing_before = _regions.publish_failure, _regions.failing_before

DEFAULT_TIMEOUT_S = _env.read("FOP_COORDINATION_TIMEOUT_S")  # the default stall timeout
POLL_S = 0.25  # the longest slice of a wait in a region between looks at its failures
_COUNTER = itertools.count()

CALLS = _regions.CALLS  # coordination calls of this process, by kind: tests count them
_SESSION: list[str] = []
_SESSION_LOCK = threading.Lock()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    return jax.process_index() == 0


def next_operation_id(kind: str, *, region: Region | None) -> str:
    """A name every process derives identically for its n-th operation of this kind (in
    a region: its n-th of the region's)."""
    return f"fop/{kind}/{next(_COUNTER) if region is None else region.draw()}"


def stall_timeout(explicit: float | None = None, *, region: Region | None) -> float:
    """The stall timeout of a wait in ``region``: ``explicit`` if given, else the
    region's (a manager's ``stall_timeout=``), else ``FOP_COORDINATION_TIMEOUT_S``."""
    if explicit is not None:
        return explicit
    found = None if region is None else region.stall_s
    return DEFAULT_TIMEOUT_S if found is None else found


def _stall_name(region: Region | None) -> str:
    unset = region is None or region.stall_s is None
    return "FOP_COORDINATION_TIMEOUT_S" if unset else "stall_timeout"


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
    """The value under ``key`` once ``process`` set it: the one wait on other processes.

    It waits in slices of at most :data:`POLL_S`, looking between them at the failures
    published in ``region`` and (:class:`liveness.PeerWatch`) at ``process``'s heartbeat:
    a live process is waited for as long as it makes progress, with the late processes
    (``late()``, default ``[process]``) logged every ``FOP_LATE_REPORT_S``; a dead one
    (its heartbeat stopped ``FOP_PEER_SILENT_S`` ago) raises CoordinationError naming it
    within seconds, and so does, after ``timeout`` (the stall timeout), one that made no
    progress that long or was never seen beating (it may not have started)."""
    client, me = _client(), process_index()
    _regions.ensure_beating(client, me)
    watch = _regions.PeerWatch(
        client,
        me,
        f"{key!r} from process {process}",
        stall_s=timeout,
        late=late or (lambda: [process]),
        region=None if region is None else region.kind,
        stall_name=_stall_name(region),
        operation=None if region is None else (region.kind, region.tag),
        elsewhere=functools.partial(_other_paths.raise_elsewhere, region),
    )
    piece = 0.02
    with _regions.ACTIVITIES.doing(f"waiting for {key!r} from process {process}"):
        while True:
            try:
                return client.blocking_key_value_get(key, max(1, int(piece * 1000)))
            except Exception as e:  # the client raises XlaRuntimeError / JaxRuntimeError
                if not _timed_out(e):
                    raise CoordinationError(describe(str(e))) from e
            raise_published_failure(region, process)
            _regions.raise_if_left(process, key, region)
            watch.look(process)
            piece = min(2 * piece, POLL_S)


def spans_processes(*trees: Any) -> bool:
    """Whether a sharding in ``trees`` (leaves with a ``.sharding``, or shardings) places
    data on devices of other processes: a read onto them is collective."""
    if jax.process_count() == 1:
        return False
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
    for leaf in jax.tree_util.tree_leaves(trees, is_leaf=is_sharding):
        found = leaf if is_sharding(leaf) else getattr(leaf, "sharding", None)
        if isinstance(getattr(found, "mesh", None), jax.sharding.AbstractMesh):
            mesh = jax.sharding.get_mesh()  # set_mesh's, onto which the read places it
            if not mesh.empty and not mesh.is_multi_process:
                continue
            return not mesh.empty  # none: refused by the read, naming the leaf
        if is_sharding(found) and not found.is_fully_addressable:
            return True
    return False


def barrier(name: str, *, region: Region | None, timeout_s: float | None = None) -> None:
    """Blocks until every process reached ``name``; raises CoordinationError naming the
    missing processes (a key-value barrier: it waits through :func:`_wait`, each
    process given the stall timeout ``timeout_s``, default :func:`stall_timeout`)."""
    if process_count() == 1:
        return
    timeout = stall_timeout(timeout_s, region=region)
    CALLS["barrier"] += 1
    _regions.fault_point(region)
    client, me = _client(), process_index()
    client.key_value_set(f"{name}/at/{me}", "1")

    def describe(said: str) -> str:
        missing = [p for p in range(process_count()) if p != me and not _is_set(f"{name}/at/{p}")]
        return (
            f"process {me} of {process_count()}: not every process reached barrier {name!r} "
            f"(missing process(es): {', '.join(map(str, missing))}; {said})"
        )

    def late() -> list[int]:
        return [p for p in range(process_count()) if p != me and not _is_set(f"{name}/at/{p}")]

    for p in range(process_count()):
        if p != me:
            _wait(f"{name}/at/{p}", timeout, describe, p, region=region, late=late)


def _is_set(key: str) -> bool:
    try:
        _client().key_value_try_get(key)
        return True
    except Exception:  # noqa: BLE001  (NOT_FOUND, or a service gone: not there either way)
        return False


def broadcast_str(
    name: str, value: str | None, *, region: Region | None, timeout_s: float | None = None
) -> str:
    """The primary's ``value`` on every process (others pass anything)."""
    if process_count() == 1:
        assert value is not None
        return value
    timeout = stall_timeout(timeout_s, region=region)
    _regions.fault_point(region)
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
        _regions.fault_point(region)
        CALLS["kv_set"] += 1
        _client().key_value_set(f"{name}/{process_index()}", value)


def forget(name: str) -> None:
    """Deletes this process's value under ``name/<process>`` (see :func:`publish`), once
    every process has read it: values stay in the coordination service until deleted.
    Errors are ignored (a value left behind costs memory, nothing else)."""
    if process_count() > 1:
        CALLS["kv_delete"] += 1
        try:
            _client().key_value_delete(f"{name}/{process_index()}")
        except Exception:  # noqa: BLE001
            pass


def gather_str(name: str, *, region: Region | None, timeout_s: float | None = None) -> list[str]:
    """Values that every process published under ``name``, by process index."""
    return [get_from(name, p, region=region, timeout_s=timeout_s) for p in range(process_count())]


def poll(name: str, *, region: Region | None, wait_s: float) -> str | None:
    """The value under ``name``, waiting at most ``wait_s``; None when none was set by
    then. For a background thread that follows another process's decisions and must
    stay responsive to its own shutdown (a long wait is a loop of short polls)."""
    _regions.fault_point(region)
    CALLS["kv_get"] += 1
    try:
        return _client().blocking_key_value_get(name, max(1, int(wait_s * 1000)))
    except Exception as e:
        if _timed_out(e):
            raise_published_failure(region)
            return None
        raise CoordinationError(f"process {process_index()}: reading {name!r}: {e}") from e


def session_nonce(*, region: Region | None) -> str:
    """A random name shared by every process, agreed once per process lifetime (the
    primary's, under one fixed key: each process reads it at its first call, whenever
    that is, so a process that failed before reading it meets the others again); later
    saves derive their staging names from it and a counter, with no coordination
    (``region``: the operation that asks first, whose waits it makes)."""
    with _SESSION_LOCK:
        if not _SESSION:
            _SESSION.append(broadcast_str("fop/session", secrets.token_hex(4), region=region))
        return _SESSION[0]


def unique_name(*, region: Region | None) -> str:
    """``<session>x<n>``: identical on every process for its n-th call (SPMD order; in a
    region ``<session>x<region>y<n>``, its n-th of the region's)."""
    drawn = next(_NAMES) if region is None else region.draw().replace(".", "y")
    return f"{session_nonce(region=region)}x{drawn}"


_NAMES = itertools.count()


def get_from(
    name: str, process: int, *, region: Region | None, timeout_s: float | None = None
) -> str:
    """The value ``process`` published under ``name`` (see :func:`publish`)."""
    timeout = stall_timeout(timeout_s, region=region)
    _regions.fault_point(region)
    CALLS["kv_get"] += 1
    return _wait(
        f"{name}/{process}",
        timeout,
        lambda e: f"no value {name!r} from process {process} ({e})",
        process,
        region=region,
    )


def gather_json(kind: str, value: Any, *, region: Region | None) -> list[Any]:
    """Collective: every process's JSON ``value``, by process index (one key-value
    round; with one process, ``[value]``)."""
    if process_count() == 1:
        return [value]
    op = next_operation_id(kind, region=region)
    publish(op, json.dumps(value), region=region)
    # the values are kept (not forgotten): a peer may not have read ours yet
    return [json.loads(v) for v in gather_str(op, region=region)]


def agree(kind: str, error: BaseException | None, *, region: Region | None, what: str) -> None:
    """Collective: every process learns whether any process failed at this point.

    Re-raises ``error`` (this process's own, once every process has learned of it); else
    raises, on every process that succeeded, an error of the failed process's class (a
    :class:`CheckpointError` subclass, else CheckpointError itself) naming that process;
    returns when every process succeeded. One key-value round. So a restore that fails
    on one process (a damaged chunk only it reads) fails on all of them, together and
    at once: none goes on with a state the others did not restore, none waits in a
    collective the failed one never enters.
    """
    if process_count() == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else {"type": type(error).__name__, "message": str(error)}
    op = next_operation_id(kind, region=region)
    if error is not None:  # a process waiting elsewhere in the region must not wait for us
        _regions.announce_agreement(op, error, region)
    if region is not None:
        region.agreeing = op
    try:
        publish(op, json.dumps(mine), region=region)
        views = [json.loads(v) for v in gather_str(op, region=region)]
    except ProcessFailedError:  # another left this path: this process's own error first
        if error is not None:
            raise error from None
        raise
    finally:
        if region is not None:
            region.agreeing = None
            region.agreed.add(op)
    if error is not None:
        raise error
    for p, view in enumerate(views):
        if view is not None:
            cls = getattr(_errors, view["type"], None)
            if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
                cls = CheckpointError
            raise cls(f"{what}: process {p} failed: {view['type']}: {view['message']}")
