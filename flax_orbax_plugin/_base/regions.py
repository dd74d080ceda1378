"""A collective operation's region (:class:`Region`), the coordination client and the
count of the calls made to it. A region is drawn by the public entry point
(``_base/distributed.py``) on the thread that makes the SPMD calls (the same order on
every process) and handed down as an argument.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.regions``.
"""

from __future__ import annotations

import collections
import dataclasses

from .._errors import CoordinationError

# Coordination calls made by this process, by kind ("barrier", "kv_set", "kv_get",
# "kv_delete", "failure_check"): tests assert how many one save costs.
CALLS: collections.Counter[str] = collections.Counter()


def client():
    """jax's coordination service client (raises CoordinationError without one)."""
    from jax._src.distributed import global_state  # private: read when called, not at import

    found = global_state.client
    if found is None:
        raise CoordinationError(
            "several JAX processes but no coordination client: call jax.distributed.initialize()"
        )
    return found


def is_set(key: str) -> bool:
    """Whether ``key`` is set in the coordination service now (a service gone: no)."""
    try:
        client().key_value_try_get(key)
        return True
    except Exception:  # noqa: BLE001  (NOT_FOUND, or a service gone: not there either way)
        return False


@dataclasses.dataclass
class Region:
    """One collective operation: its kind (``manager-save`` ...) and its tag, the same on
    every process; the names drawn in it so far, the agreement it is in and those it
    completed, its waits' stall timeout (``stall_s``; None: ``FOP_COORDINATION_TIMEOUT_S``)
    and ``scope``: the tag of the manager's open it belongs to, or None. Its names are
    drawn on the thread that makes the SPMD calls, or by a background phase after that
    thread's last draw in it (``SaveHandle``)."""

    kind: str
    tag: str
    drawn: int = 0
    stall_s: float | None = None
    scope: str | None = None
    agreeing: str | None = None
    agreed: set[str] = dataclasses.field(default_factory=set)

    def draw(self) -> str:
        """``<tag>.<n>``: the n-th name drawn in this region."""
        self.drawn += 1
        return f"{self.tag}.{self.drawn - 1}"
