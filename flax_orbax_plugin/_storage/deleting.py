"""Deleting the objects of a place on a kvstore, many at once and paced (for
``_core.ownership`` only).

``delete_objects`` runs on the calling thread, its batches on short-lived threads joined
before it returns.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.deleting``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import tensorstore as ts

from . import server_copy as _server_copy
from .contexts import context
from .location import Location

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
    """Deletes ``keys`` of ``kv`` (opened on ``loc``): by batch requests where the store
    has them (:func:`batch_deleter`), else one request each (:func:`delete_keys`)."""
    batch = batch_deleter(loc) if len(keys) > 1 else None
    if batch is not None:
        delete_batches(batch, loc.spec.get("path", ""), keys, pace)
    else:
        delete_keys(kv, keys, pace)


def batch_deleter(loc: Location) -> _server_copy.Copier | None:
    """S3's DeleteObjects for the objects under ``loc`` (botocore, as ``server_copy``),
    or None (another store, no botocore or no credentials)."""
    if loc.spec.get("driver") != "s3":
        return None  # GCS: its JSON batch endpoint is not reachable in the emulator
    copier, _why = _server_copy.copier_for(loc)
    return copier if copier is not None and copier.batch_limit > 0 else None


def delete_batches(
    copier: _server_copy.Copier, prefix: str, keys: list[bytes], pace: Callable[[], int] | None
) -> None:
    """Deletes ``keys`` (relative to ``prefix``) by batch requests, up to ``pace()`` of
    them in flight, each on a thread (0 pauses, as in :func:`delete_keys`). Raises the
    first batch's CopyError once every batch in flight ended."""
    names = [prefix + k.decode() for k in keys]
    batches = [names[i : i + copier.batch_limit] for i in range(0, len(names), copier.batch_limit)]
    in_flight: collections.deque = collections.deque()
    errors: list[BaseException] = []

    def run(batch: list[str]) -> None:
        try:
            copier.delete_batch(batch)
        except BaseException as e:  # noqa: BLE001  (raised below, on the caller's thread)
            errors.append(e)

    def settle(keep: int) -> None:
        while len(in_flight) > keep:
            in_flight.popleft().join()

    for batch in batches:
        width = pace() if pace is not None else REMOVAL_CONCURRENCY
        while width < 1:
            settle(0)
            time.sleep(PAUSED_POLL_S)
            width = pace()
        settle(width - 1)
        thread = threading.Thread(target=run, args=(batch,), name="fop-delete-batch")
        thread.start()
        in_flight.append(thread)
    settle(0)
    if errors:
        raise errors[0]


def delete_keys(kv: ts.KvStore, keys: list[bytes], pace: Callable[[], int] | None) -> None:
    """Deletes ``keys`` of ``kv``, one request each, keeping ``pace()`` of them in flight
    (default :data:`REMOVAL_CONCURRENCY`), asked before each request (a removal slows
    down while a save runs); 0 pauses it: every request in flight is waited for, then
    it asks again every :data:`PAUSED_POLL_S`."""
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
