"""tensorstore, imported at its first use, and the contexts every open of a kvstore
shares, created once per kind, lazily, under a lock: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.location``.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from .._base import env as _env

if TYPE_CHECKING:
    import tensorstore as ts


def tensorstore() -> Any:
    """The tensorstore module, imported at its first use (about a second) rather than
    with this module: ``flax-orbax list`` never needs it."""
    import tensorstore as ts  # inside on purpose: see the docstring

    return ts


_CONTEXTS: dict[tuple[bool, int], ts.Context] = {}


_CONTEXT_LOCK = threading.Lock()


def context(*, local: bool = True, requests: int = 32) -> ts.Context:
    """The tensorstore context shared by every open: caches off, no fsync by tensorstore
    (see :meth:`Location.sync`). Local disks get few concurrent file operations (more
    only raised peak memory on restore, measured here), object stores ``requests``
    (latency; removals have their own: ``deleting.removal_context``).
    """
    with _CONTEXT_LOCK:
        if (local, requests) not in _CONTEXTS:
            spec: dict[str, Any] = {
                "cache_pool": {"total_bytes_limit": 0},
                "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
            }
            if local:
                spec["file_io_sync"] = False
                spec["file_io_concurrency"] = {"limit": 8}
            else:
                # FOP_STORE_RETRIES, the delay doubling to 10 s: an unreachable store fails
                # in about a minute (tensorstore's default retried ~15 minutes, silently).
                retries = {
                    "max_retries": _env.read("FOP_STORE_RETRIES"),
                    "initial_delay": "0.5s",
                    "max_delay": "10s",
                }
                spec["s3_request_concurrency"] = {"limit": requests}
                spec["gcs_request_concurrency"] = {"limit": requests}
                spec["s3_request_retries"] = spec["gcs_request_retries"] = retries
            _CONTEXTS[local, requests] = tensorstore().Context(spec)
        return _CONTEXTS[local, requests]


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    key_range = tensorstore().KvStore.KeyRange
    if not prefix:
        return key_range()
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return key_range(inclusive_min=prefix, exclusive_max=end)
