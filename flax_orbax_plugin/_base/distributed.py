"""Multi-process coordination through jax.distributed's coordination service.

With one process every function here is a no-op. With several (after
``jax.distributed.initialize``), every process must call the same functions in
the same order (SPMD); process 0 is the primary: it writes metadata and
commits. Barriers carry a timeout so that a dead process turns into a
:class:`CoordinationError` naming the barrier instead of a hang.

Thread-safety: the coordination client is thread-safe; barrier and key names
are unique per save, so a background thread may call these while the
training thread runs.
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import secrets
import threading
from typing import Any

import jax

from .. import _errors
from .._errors import CheckpointError, CoordinationError
from . import env as _env

DEFAULT_TIMEOUT_S = _env.read("FOP_COORDINATION_TIMEOUT_S")
_COUNTER = itertools.count()

# Coordination calls made by this process, by kind ("barrier", "kv_set", "kv_get",
# "kv_delete"):
# tests assert how many one save costs.
CALLS: collections.Counter[str] = collections.Counter()
_SESSION: list[str] = []
_SESSION_LOCK = threading.Lock()


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    return jax.process_index() == 0


def _client():
    from jax._src.distributed import global_state

    client = global_state.client
    if client is None:
        raise CoordinationError(
            "several JAX processes but no coordination client: call jax.distributed.initialize()"
        )
    return client


def next_operation_id(kind: str) -> str:
    """A name every process derives identically for its n-th operation of this kind."""
    return f"fop/{kind}/{next(_COUNTER)}"


def barrier(name: str, *, timeout_s: float | None = None) -> None:
    """Blocks until every process reached ``name``; raises CoordinationError on timeout."""
    if process_count() == 1:
        return
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    CALLS["barrier"] += 1
    try:
        _client().wait_at_barrier(name, int(timeout * 1000))
    except Exception as e:  # the client raises XlaRuntimeError / JaxRuntimeError
        missing = _missing_processes(str(e))
        who = f"missing process(es): {', '.join(map(str, missing))}; " if missing else ""
        raise CoordinationError(
            f"process {process_index()} of {process_count()}: not every process reached "
            f"barrier {name!r} within {timeout:.0f}s ({who}{e})"
        ) from e


def _missing_processes(text: str) -> list[int]:
    """Process ids that jax's coordination service names as absent in an error text."""
    found = set()
    names = re.search(r"timed out task names:\s*([0-9][0-9,\s]*)", text)
    if names:
        found.update(int(n) for n in re.findall(r"[0-9]+", names.group(1)))
    found.update(int(n) for n in re.findall(r"[Tt]ask (?:id )?([0-9]+) heartbeat timeout", text))
    found.update(int(n) for n in re.findall(r"/task:([0-9]+)", text))
    return sorted(found)


def broadcast_str(name: str, value: str | None, *, timeout_s: float | None = None) -> str:
    """The primary's ``value`` on every process (others pass anything)."""
    if process_count() == 1:
        assert value is not None
        return value
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    client = _client()
    if is_primary():
        CALLS["kv_set"] += 1
        client.key_value_set(name, value)
        return value
    CALLS["kv_get"] += 1
    try:
        return client.blocking_key_value_get(name, int(timeout * 1000))
    except Exception as e:
        raise CoordinationError(
            f"process {process_index()}: no value for {name!r} from the primary within "
            f"{timeout:.0f}s ({e})"
        ) from e


def publish(name: str, value: str) -> None:
    """Stores this process's ``value`` under ``name/<process>`` for :func:`gather_str`."""
    if process_count() > 1:
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


def gather_str(name: str, *, timeout_s: float | None = None) -> list[str]:
    """Values that every process published under ``name``, by process index."""
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    client = _client()
    out = []
    for p in range(process_count()):
        CALLS["kv_get"] += 1
        try:
            out.append(client.blocking_key_value_get(f"{name}/{p}", int(timeout * 1000)))
        except Exception as e:
            raise CoordinationError(
                f"no value {name!r} from process {p} within {timeout:.0f}s ({e})"
            ) from e
    return out


def poll(name: str, *, wait_s: float) -> str | None:
    """The value under ``name``, waiting at most ``wait_s``; None when none was set by
    then. For a background thread that follows another process's decisions and must
    stay responsive to its own shutdown (a long wait is a loop of short polls)."""
    CALLS["kv_get"] += 1
    try:
        return _client().blocking_key_value_get(name, max(1, int(wait_s * 1000)))
    except Exception as e:
        if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e):
            return None
        raise CoordinationError(f"process {process_index()}: reading {name!r}: {e}") from e


def session_nonce() -> str:
    """A random name shared by every process, agreed once per process lifetime (the first
    call is collective: one key-value round); later saves derive their staging names
    from it and a counter, with no coordination."""
    with _SESSION_LOCK:
        if not _SESSION:
            mine = secrets.token_hex(4)
            _SESSION.append(broadcast_str(next_operation_id("session"), mine))
        return _SESSION[0]


def unique_name() -> str:
    """``<session>x<n>``: identical on every process for its n-th call (SPMD order)."""
    return f"{session_nonce()}x{next(_NAMES)}"


_NAMES = itertools.count()


def get_from(name: str, process: int, *, timeout_s: float | None = None) -> str:
    """The value ``process`` published under ``name`` (see :func:`publish`)."""
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    CALLS["kv_get"] += 1
    try:
        return _client().blocking_key_value_get(f"{name}/{process}", int(timeout * 1000))
    except Exception as e:
        raise CoordinationError(
            f"no value {name!r} from process {process} within {timeout:.0f}s ({e})"
        ) from e


def gather_json(kind: str, value: Any) -> list[Any]:
    """Collective: every process's JSON ``value``, by process index (one key-value
    round; with one process, ``[value]``)."""
    if process_count() == 1:
        return [value]
    op = next_operation_id(kind)
    publish(op, json.dumps(value))
    return [json.loads(v) for v in gather_str(op)]  # kept: a peer may not have read ours


def agree(kind: str, error: BaseException | None, *, what: str) -> None:
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
    views = gather_json(kind, mine)
    if error is not None:
        raise error
    for p, view in enumerate(views):
        if view is not None:
            cls = getattr(_errors, view["type"], None)
            if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
                cls = CheckpointError
            raise cls(f"{what}: process {p} failed: {view['type']}: {view['message']}")
