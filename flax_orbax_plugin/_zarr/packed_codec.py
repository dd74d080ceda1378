"""Format version 2's compressed segments (byte for byte version 1's chunk files), encoded
and decoded by tensorstore's zarr3 driver over a private ``memory`` kvstore (a fresh
context each): this library has no zstd of its own. Any thread; one :class:`Decoder` per
read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorstore as ts

from .._storage.location import Location
from . import arrays as _arrays
from . import chunks as _chunks

MEMORY = Location.from_path("memory://")  # the root the specs below are built under
_ZARR_JSON = b"zarr.json"


def max_segment_bytes(raw_bytes: int, inner_chunks: int = 1) -> int:
    """The most bytes a compressed segment of ``raw_bytes`` decoded bytes in
    ``inner_chunks`` checksummed chunks may hold: a data index listing more is damage."""
    frames = raw_bytes + raw_bytes // 128 + inner_chunks * (1024 + _chunks.CRC_BYTES)
    return frames + 16 * inner_chunks + _chunks.CRC_BYTES


def encode(spec: dict[str, Any], writes: list[tuple[Any, np.ndarray]]) -> list[tuple[str, Any]]:
    """``[(key inside the array, stored bytes)]`` of every chunk of ``writes`` (regions of
    whole chunks, values) encoded with ``spec`` (under :data:`MEMORY`), sorted by key."""
    context = ts.Context()
    spec = dict(spec, store_data_equal_to_fill_value=True)
    store = ts.open(spec, create=True, open=True, context=context).result()
    for index, data in writes:
        store[index].write(_arrays.as_stored(data, store.dtype.numpy_dtype)).result()
    kv = ts.KvStore.open(spec["kvstore"], context=context).result()
    out = []
    for key in sorted(kv.list().result()):
        if key != _ZARR_JSON:
            out.append((key.decode("ascii"), kv.read(key).result().value))
    return out


class Decoder:
    """A zarr3 array of ``spec`` (under :data:`MEMORY`) in its own memory: :meth:`put` each
    stored chunk a read needs, then read :attr:`store` (a chunk not put is an error)."""

    def __init__(self, spec: dict[str, Any]):
        self._context = ts.Context()
        spec = dict(spec, fill_missing_data_reads=False)
        self.store = ts.open(spec, create=True, context=self._context).result()
        self._kv = ts.KvStore.open(spec["kvstore"], context=self._context).result()

    def put(self, key: str, data: Any) -> None:
        """Stores ``data`` (bytes of one segment) as the chunk ``key`` (``c/...``)."""
        self._kv.write(key, bytes(data)).result()
