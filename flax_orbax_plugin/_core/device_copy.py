"""Device-to-host copies of the regions a save writes from accelerator arrays.

Two ways, chosen per save by :func:`start` (blocking phase, training thread):

* **staged** (the default): each region is copied with ``jax.device_put`` into
  ``pinned_host`` memory, the page-locked host memory the device's DMA engines write
  without a bounce buffer. ``device_put`` only enqueues the copy, so the blocking
  phase is the time to enqueue them; the copies overlap the following steps, and the
  step that donates the state waits only for the copies that read it (jax orders a
  donation after the buffer's pending reads). Where a device has no ``pinned_host``
  memory, ``copy_to_host_async`` into ordinary host memory is started instead.
* **streamed** (a save with ``host_memory_budget``): nothing is copied to host in the
  blocking phase. Each region is copied on its device instead (a device-side copy at
  the device's memory bandwidth, enqueued; it costs one more state of device memory
  until written): holding the array itself would not do, since a donating step
  invalidates a donated array whoever holds it. The background writer copies each
  region to host when it gets to it, never holding more than the budget in host
  memory at once (``write_data``'s in-flight bound). Regions larger than a fraction of
  the budget are split into pieces of whole chunk rows (:func:`pieces`).

Either way the save's writes hold a :class:`Deferred` where they would hold host bytes,
and the background phase calls :func:`materialize` (on its own thread) when it needs
them. On CPU, jax arrays are host memory already and take neither way, unless
:data:`CPU_AS_DEVICE` is set (tests and ``benchmarks/gpu_check.py`` exercise the
device path on CPU: jax's CPU client has a ``pinned_host`` memory too).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CPU_AS_DEVICE = False  # treat CPU arrays as device arrays (exercises this path on CPU)


class Deferred:
    """A region's bytes, still on a device or on their way to host memory."""

    __slots__ = ("array",)

    def __init__(self, array: jax.Array):
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.array.dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def on_device(data: Any) -> bool:
    """Whether ``data`` (a single-device jax.Array) takes the device path."""
    if not isinstance(data, jax.Array):
        return False
    return CPU_AS_DEVICE or next(iter(data.devices())).platform != "cpu"


def start(data: jax.Array, part: tuple[slice, ...] | None, *, streamed: bool) -> Deferred:
    """The region ``part`` (None: all) of the single-device array ``data``, staged into
    pinned host memory (copy enqueued) or, ``streamed``, copied on the device."""
    if streamed:  # a copy on the device, which no donation of ``data`` invalidates
        return Deferred(jnp.copy(data) if part is None else data[part])
    region = data if part is None else data[part]
    device = next(iter(region.devices()))
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" in kinds:
        target = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        return Deferred(jax.device_put(region, target))
    region.copy_to_host_async()
    return Deferred(region)


def materialize(data: Any) -> Any:
    """Host bytes of ``data`` (a :class:`Deferred` is copied, or waited for, here)."""
    if isinstance(data, Deferred):
        return np.asarray(data.array)
    return data


def materialize_all(leaves: list) -> None:
    """Every :class:`Deferred` of the leaves' writes replaced by its host bytes (for
    the writers that read every region up front: format version 2, incremental)."""
    for leaf in leaves:
        writes = getattr(leaf, "writes", None)
        if writes:
            leaf.writes = [(rows, materialize(data)) for rows, data in writes]


def pieces(
    rows: tuple[slice, ...], length: int, chunk_rows: int, row_bytes: int, most: int
) -> list:
    """``rows`` (a region of whole chunk rows along axis 0 of an array of ``length``
    rows) cut into consecutive regions of whole chunk rows of at most ``most`` bytes
    each (at least one chunk row)."""
    if not rows or row_bytes <= 0:
        return [rows]
    start = rows[0].start or 0
    stop = length if rows[0].stop is None else rows[0].stop
    step = max(1, most // (row_bytes * chunk_rows)) * chunk_rows
    if stop - start <= step:
        return [rows]
    return [(slice(lo, min(lo + step, stop)),) + tuple(rows[1:]) for lo in range(start, stop, step)]
