"""tensorstore, imported at its first use, and the contexts every open of a kvstore shares.

Contexts are created once per kind of store (local, object store), lazily, under a lock:
safe from any thread. A local save or restore of format version 2 opens none (its files
are read and written directly: ``local_files``, ``_zarr``).

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
    """The tensorstore module, imported at its first use rather than with this module:
    a command that reads a few JSON files of a local disk (``flax-orbax list``) never
    needs it, and its import takes about a second. Any thread."""
    import tensorstore as ts  # inside on purpose: see the docstring

    return ts


_CONTEXTS: dict[bool, ts.Context] = {}


_CONTEXT_LOCK = threading.Lock()


def context(*, local: bool = True) -> ts.Context:
    """The tensorstore context shared by every open: caches off, no fsync by tensorstore
    (see :meth:`Location.sync`). Local disks get few concurrent file operations (more
    only raised peak memory on restore, measured here), object stores many (latency).
    """
    with _CONTEXT_LOCK:
        if local not in _CONTEXTS:
            spec: dict[str, Any] = {
                "cache_pool": {"total_bytes_limit": 0},
                "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
            }
            if local:
                spec["file_io_sync"] = False
                spec["file_io_concurrency"] = {"limit": 8}
            else:
                spec["s3_request_concurrency"] = {"limit": 32}
                spec["gcs_request_concurrency"] = {"limit": 32}
                spec["s3_request_retries"] = spec["gcs_request_retries"] = store_retries()
            _CONTEXTS[local] = tensorstore().Context(spec)
        return _CONTEXTS[local]


def store_retries() -> dict[str, Any]:
    """The retries of an object store request: ``FOP_STORE_RETRIES`` (default 8), the
    delay doubling from 0.5 s to at most 10 s, so that a store that cannot be reached (a
    wrong endpoint, the server gone mid-save) fails in about a minute. tensorstore's own
    default retried for about 15 minutes, silently, while a save's blocking phase held
    back Ctrl-C."""
    return {
        "max_retries": _env.read("FOP_STORE_RETRIES"),
        "initial_delay": "0.5s",
        "max_delay": "10s",
    }


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    key_range = tensorstore().KvStore.KeyRange
    if not prefix:
        return key_range()
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return key_range(inclusive_min=prefix, exclusive_max=end)
