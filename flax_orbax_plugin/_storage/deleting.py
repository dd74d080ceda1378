"""Deleting the objects of a place on a kvstore, many at once and paced (for
``_core.ownership`` only).

``delete_objects`` runs on the calling thread, its batches on short-lived threads joined
before it returns.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.deleting``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import tensorstore as ts

from . import server_copy as _server_copy
from .location import Location, context

REMOVAL_CONCURRENCY = 8  # delete requests in flight by default (S3 / GCS)
PAUSED_POLL_S = 0.01  # how often a paused removal asks whether it may go on


def removal_context(spec: dict[str, Any]) -> ts.Context:
    """The context a removal opens ``spec`` in: on S3 and GCS one of its own (its own
    request slots, not a save's); other stores the shared one (a ``memory://`` store
    lives in its context)."""
    if spec.get("driver") not in ("s3", "gcs"):
        return context(local=spec.get("driver") == "file")
    return context(local=False, requests=REMOVAL_CONCURRENCY)


def delete_objects(
    loc: Location, kv: ts.KvStore, keys: list[bytes], pace: Callable[[], int] | None
) -> None:
    """Deletes ``keys`` of ``kv`` (opened on ``loc``), paced as :func:`delete_keys`: on S3
    by DeleteObjects requests, each on a thread (botocore, as ``server_copy``; GCS's JSON
    batch endpoint is not reachable in the emulator), raising the first batch's CopyError
    once every batch in flight ended; else one request each."""
    s3 = loc.spec.get("driver") == "s3" and len(keys) > 1
    copier = _server_copy.copier_for(loc)[0] if s3 else None
    if copier is None or copier.batch_limit < 1:
        return delete_keys(kv, keys, pace)
    names = [loc.spec.get("path", "") + k.decode() for k in keys]
    errors: list[BaseException] = []

    def start(batch: list[str]) -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                copier.delete_batch(batch)
            except BaseException as e:  # noqa: BLE001  (raised below, on the caller's thread)
                errors.append(e)
            finally:
                done.set_result(None)

        threading.Thread(target=run, name="fop-delete-batch").start()
        return done

    n = copier.batch_limit
    _paced((functools.partial(start, names[i : i + n]) for i in range(0, len(names), n)), pace)
    if errors:
        raise errors[0]


def delete_keys(kv: ts.KvStore, keys: list[bytes], pace: Callable[[], int] | None) -> None:
    """Deletes ``keys`` of ``kv``, one request each, keeping ``pace()`` of them in flight
    (default :data:`REMOVAL_CONCURRENCY`), asked before each request (a removal slows
    down while a save runs); 0 pauses it: every request in flight is waited for, then
    it asks again every :data:`PAUSED_POLL_S`."""
    _paced((functools.partial(kv.write, key, None) for key in keys), pace)


def _paced(starts: Iterable[Callable[[], Any]], pace: Callable[[], int] | None) -> None:
    """Calls each of ``starts`` (each starts a request: its future) as :func:`delete_keys`
    paces them; returns when every one ended."""
    in_flight: collections.deque = collections.deque()
    for start in starts:
        width = pace() if pace is not None else REMOVAL_CONCURRENCY
        while width < 1:  # paused (a save's blocking phase: short): none in flight
            while in_flight:
                in_flight.popleft().result()
            time.sleep(PAUSED_POLL_S)
            width = pace()
        while len(in_flight) >= width:
            in_flight.popleft().result()
        in_flight.append(start())
    while in_flight:
        in_flight.popleft().result()
