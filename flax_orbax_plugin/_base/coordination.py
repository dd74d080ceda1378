"""The key-value rounds of several processes (:class:`Rounds`, the base of the collective
object ``_base.distributed.Region``): a barrier, a broadcast, publish and gather, a poll,
an agreement, each through the one wait (:meth:`Rounds._wait`), which looks at the
others' heartbeats (``_base.liveness``) and published failures (``_base.failures``).
With one process every round returns at once: only several processes run this module.

Threading: every process calls the same rounds of its region in the same order (SPMD),
on the thread that makes the SPMD calls, or in a background phase after that thread's
last draw in the region (``SaveHandle``).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.regions``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from .. import _errors
from .._errors import CheckpointError, CoordinationError, ProcessFailedError
from . import env as _env
from . import failures as _failures
from . import host as _host
from . import liveness as _liveness
from .host import is_primary, process_count, process_index
from .regions import CALLS, is_set
from .regions import client as _client

DEFAULT_TIMEOUT_S = _env.read("FOP_COORDINATION_TIMEOUT_S")  # the default stall timeout
POLL_S = 0.25  # the longest slice of a wait in a region between looks at its failures


def _timed_out(e: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e)


class Rounds:
    """The rounds of a collective object (a ``Region``'s base): it reads the region's
    ``kind``, ``spans``, ``stall_s``, ``agreeing`` and ``agreed`` and draws names with its
    ``next_operation_id``."""

    kind: str
    stall_s: float | None
    agreeing: str | None
    agreed: set[str]

    def stall_timeout(self, explicit: float | None = None) -> float:
        """The stall timeout of a wait here: ``explicit`` if given, else the region's (a
        manager's ``stall_timeout=``), else ``FOP_COORDINATION_TIMEOUT_S``."""
        if explicit is not None:
            return explicit
        return DEFAULT_TIMEOUT_S if self.stall_s is None else self.stall_s

    def fault_point(self) -> None:
        """Before each coordination call: the fault point of this region's kind
        (``FOP_FAIL_AT=collective-<kind>[:N]``, see ``_base.env``), where it spans."""
        if self.spans:
            _env.fail_point(f"collective-{self.kind}")

    def barrier(self, name: str, *, timeout_s: float | None = None) -> None:
        """Blocks until every process reached ``name`` (a key-value barrier); raises
        CoordinationError naming the missing processes."""
        if process_count() == 1:
            return
        timeout = self.stall_timeout(timeout_s)
        CALLS["barrier"] += 1
        self.fault_point()
        client, me = _client(), process_index()
        client.key_value_set(f"{name}/at/{me}", "1")

        def late() -> list[int]:
            return [p for p in range(process_count()) if p != me and not is_set(f"{name}/at/{p}")]

        def describe(said: str) -> str:
            return (
                f"process {me} of {process_count()}: not every process reached barrier "
                f"{name!r} (missing process(es): {', '.join(map(str, late()))}; {said})"
            )

        for p in range(process_count()):
            if p != me:
                self._wait(f"{name}/at/{p}", timeout, describe, p, late=late)

    def broadcast_str(self, name: str, value: str | None, *, timeout_s: float | None = None) -> str:
        """The primary's ``value`` on every process (others pass anything)."""
        if process_count() == 1:
            assert value is not None
            return value
        timeout = self.stall_timeout(timeout_s)
        self.fault_point()
        if is_primary():
            CALLS["kv_set"] += 1
            _client().key_value_set(name, value)
            return value
        CALLS["kv_get"] += 1
        me = process_index()
        describe = lambda e: f"process {me}: no value for {name!r} from the primary ({e})"
        return self._wait(name, timeout, describe, 0)

    def publish(self, name: str, value: str) -> None:
        """Stores this process's ``value`` under ``name/<process>`` for :meth:`gather_str`."""
        if process_count() > 1:
            self.fault_point()
            CALLS["kv_set"] += 1
            _client().key_value_set(f"{name}/{process_index()}", value)

    @staticmethod
    def forget(name: str) -> None:
        """Deletes this process's value under ``name/<process>`` once every process read
        it (errors ignored: a value left behind costs memory only; needs no region)."""
        if process_count() > 1:
            CALLS["kv_delete"] += 1
            with contextlib.suppress(Exception):
                _client().key_value_delete(f"{name}/{process_index()}")

    def get_from(self, name: str, process: int, *, timeout_s: float | None = None) -> str:
        """The value ``process`` published under ``name`` (see :meth:`publish`)."""
        timeout = self.stall_timeout(timeout_s)
        self.fault_point()
        CALLS["kv_get"] += 1
        describe = lambda e: f"no value {name!r} from process {process} ({e})"
        return self._wait(f"{name}/{process}", timeout, describe, process)

    def gather_str(self, name: str, *, timeout_s: float | None = None) -> list[str]:
        """Values that every process published under ``name``, by process index."""
        return [self.get_from(name, p, timeout_s=timeout_s) for p in range(process_count())]

    def poll(self, name: str, *, wait_s: float) -> str | None:
        """The value under ``name``, waiting at most ``wait_s``; None when none was set by
        then (a background thread's short polls, responsive to its own shutdown)."""
        self.fault_point()
        CALLS["kv_get"] += 1
        try:
            return _client().blocking_key_value_get(name, max(1, int(wait_s * 1000)))
        except Exception as e:
            if _timed_out(e):
                _failures.raise_published_failure(self)
                return None
            raise CoordinationError(f"process {process_index()}: reading {name!r}: {e}") from e

    def gather_json(self, kind: str, value: Any) -> list[Any]:
        """Every process's JSON ``value``, by process index (one key-value round; with
        one process, ``[value]``)."""
        if process_count() == 1:
            return [value]
        op = self.next_operation_id(kind)
        self.publish(op, json.dumps(value))
        # the values are kept (not forgotten): a peer may not have read ours yet
        return [json.loads(v) for v in self.gather_str(op)]

    def agree(self, kind: str, error: BaseException | None, *, what: str) -> None:
        """One key-value round in which every process learns whether any failed here.

        Re-raises ``error`` (this process's own) once every process learned of it; else
        raises on every other process an error of the failed one's class (a
        CheckpointError subclass, else CheckpointError) naming it; returns when every
        process succeeded. So a restore failing on one process fails on all, at once.
        """
        if process_count() == 1:
            if error is not None:
                raise error
            return
        mine = None if error is None else {"type": type(error).__name__, "message": str(error)}
        op = self.next_operation_id(kind)
        if error is not None:  # a process waiting elsewhere in the region must not wait for us
            _failures.announce_agreement(op, error, self)
        if self.spans:
            self.agreeing = op
        try:
            self.publish(op, json.dumps(mine))
            views = [json.loads(v) for v in self.gather_str(op)]
        except ProcessFailedError:  # another left this path: this process's own error first
            if error is not None:
                raise error from None
            raise
        finally:
            if self.spans:
                self.agreeing = None
                self.agreed.add(op)
        if error is not None:
            raise error
        for p, view in enumerate(views):
            if view is not None:
                cls = getattr(_errors, view["type"], None)
                if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
                    cls = CheckpointError
                raise cls(f"{what}: process {p} failed: {view['type']}: {view['message']}")

    def _wait(
        self,
        key: str,
        timeout: float,
        describe: Callable[[str], str],
        process: int,
        *,
        late: Callable[[], list[int]] | None = None,
    ) -> str:
        """The value under ``key`` once ``process`` set it: the one wait on other
        processes, in slices of at most :data:`POLL_S`, looking between them at the
        failures published here and at ``process``'s heartbeat
        (:class:`liveness.PeerWatch`, which logs the ``late()`` processes and raises for
        a dead or stalled one)."""
        client, me = _client(), process_index()
        _liveness.ensure_beating(client, me)
        watch = _liveness.PeerWatch(
            client,
            me,
            f"{key!r} from process {process}",
            stall_s=timeout,
            late=late or (lambda: [process]),
            region=self,
        )
        piece = 0.02
        with _host.ACTIVITIES.doing(f"waiting for {key!r} from process {process}"):
            while True:
                try:
                    return client.blocking_key_value_get(key, max(1, int(piece * 1000)))
                except Exception as e:  # the client raises XlaRuntimeError / JaxRuntimeError
                    if not _timed_out(e):
                        raise CoordinationError(describe(str(e))) from e
                _failures.raise_published_failure(self, process)
                _failures.raise_if_left(process, key, self)
                watch.look(process)
                piece = min(2 * piece, POLL_S)
