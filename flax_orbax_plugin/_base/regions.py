"""The coordination client and the count of the calls made to it (the collective object
that makes them, :class:`~flax_orbax_plugin._base.distributed.Region`, is in
``_base/distributed.py``).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.regions``.
"""

from __future__ import annotations

import collections

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
