"""Deleting the objects of a place on a kvstore, many at once and paced.

The mechanics only: what may be deleted is decided, and proven ours, by
``_core.ownership`` (the one owner of removal), the only caller. S3 and GCS removals
open a tensorstore context of their own (:func:`removal_context`): their requests have
their own concurrency limit, so a step being deleted never takes the request slots of
a save writing at the same time. Tensorstore has no batch delete for S3 or GCS: each
object is one delete request, and :func:`delete_keys` keeps ``pace()`` of them in
flight (retention asks for none while the training thread is in a save, and for few
while its write runs: ``_manager/retaining.py``).

Threading: the context is created once, lazily, under a lock; :func:`delete_keys` runs
on the calling thread (the deletion thread, or the training thread for ``gc``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import tensorstore as ts

from .kvstore import context

__all__ = ["PAUSED_POLL_S", "REMOVAL_CONCURRENCY", "delete_keys", "removal_context"]

REMOVAL_CONCURRENCY = 8  # delete requests in flight by default (S3 / GCS)
PAUSED_POLL_S = 0.01  # how often a paused removal asks whether it may go on
_CONTEXT: list[ts.Context] = []
_LOCK = threading.Lock()


def removal_context(spec: dict[str, Any]) -> ts.Context:
    """The context a removal opens ``spec`` in: on S3 and GCS one of its own (see the
    module docstring); other stores the shared one (a ``memory://`` store lives in its
    context, and local files go through the file driver's own limits)."""
    if spec.get("driver") not in ("s3", "gcs"):
        return context(local=spec.get("driver") == "file")
    with _LOCK:
        if not _CONTEXT:
            _CONTEXT.append(
                ts.Context(
                    {
                        "cache_pool": {"total_bytes_limit": 0},
                        "s3_request_concurrency": {"limit": REMOVAL_CONCURRENCY},
                        "gcs_request_concurrency": {"limit": REMOVAL_CONCURRENCY},
                    }
                )
            )
        return _CONTEXT[0]


def delete_keys(kv: ts.KvStore, keys: list[bytes], pace: Callable[[], int] | None) -> None:
    """Deletes ``keys`` of ``kv``, one request each, keeping ``pace()`` of them in flight
    (default :data:`REMOVAL_CONCURRENCY`). ``pace`` is asked before each request, so a
    removal slows down as soon as a save starts and speeds up when it ends; 0 pauses it
    (every request in flight is waited for, then it asks again every
    :data:`PAUSED_POLL_S`)."""
    in_flight: collections.deque = collections.deque()
    for key in keys:
        width = pace() if pace is not None else REMOVAL_CONCURRENCY
        while width < 1:  # paused (a save's blocking phase: short): none in flight
            while in_flight:
                in_flight.popleft().result()
            time.sleep(PAUSED_POLL_S)
            width = pace()
        while len(in_flight) >= width:
            in_flight.popleft().result()
        in_flight.append(kv.write(key, None))
    while in_flight:
        in_flight.popleft().result()
