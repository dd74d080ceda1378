"""A save's accelerator arrays: the platform's staging, the copy on their devices
(blocking phase) and their transfer to host (:func:`fetch`: background phase).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.host_snapshot``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CPU_AS_DEVICE = False  # treat CPU arrays as device arrays (exercises this path on CPU)
FETCH_PIECE = 16 << 20  # bytes of one background transfer of the device staging
SNAPSHOT_HEADROOM = 0.9  # the device copy takes at most this share of a device's free memory


def staging_for(platform: str) -> str:
    if platform == "tpu" or (platform == "cpu" and CPU_AS_DEVICE):
        return "device"
    if platform in ("gpu", "cuda", "rocm"):
        return "pinned"
    return "host"


@functools.partial(jax.jit, donate_argnums=())
def _copy_all(arrays: list) -> list:
    return [jnp.copy(x) for x in arrays]


def free_bytes(device: Any) -> int | None:
    """Bytes free on ``device`` (None: the platform does not say)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (a platform without memory statistics)
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def snapshot(arrays: list) -> tuple[list | None, str]:
    """A copy of every array on its devices, or (None, why); no collective."""
    need: dict[Any, int] = {}
    for x in arrays:
        for shard in x.addressable_shards:
            need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
    for device, nbytes in need.items():
        free = free_bytes(device)
        if free is not None and nbytes > free * SNAPSHOT_HEADROOM:
            return None, (
                f"device memory short on {device}: the copy needs {nbytes} bytes, "
                f"{max(free, 0)} free"
            )
    shards = [[s.data for s in x.addressable_shards] for x in arrays]
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for i, pieces in enumerate(shards):
        for j, piece in enumerate(pieces):
            by_device.setdefault(next(iter(piece.devices())), []).append((i, j))
    copied: list[list] = [[None] * len(pieces) for pieces in shards]
    for members in by_device.values():
        outs = _copy_all([shards[i][j] for i, j in members])
        for (i, j), c in zip(members, outs, strict=True):
            copied[i][j] = c
    copies = [
        pieces[0]
        if len(pieces) == 1
        and x.sharding.is_fully_addressable
        and x.ndim == pieces[0].ndim
        and len(x.sharding.device_set) == 1
        else jax.make_array_from_single_device_arrays(x.shape, x.sharding, pieces)
        for x, pieces in zip(arrays, copied, strict=True)
    ]
    return copies, ""


@dataclasses.dataclass(slots=True, eq=False)
class Deferred:
    """A region's bytes, still on a device or on their way to host memory."""

    array: jax.Array

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


def start(data: jax.Array, part: tuple[slice, ...] | None, *, kind: str) -> Deferred:
    """The region ``part`` of single-device ``data``, started on its way as ``kind`` says."""
    if kind == "streamed":  # a copy on the device, which no donation of ``data`` invalidates
        return Deferred(jnp.copy(data) if part is None else data[part])
    region = data if part is None else data[part]
    device = next(iter(region.devices()))
    if kind == "pinned" and "pinned_host" in {m.kind for m in device.addressable_memories()}:
        target = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        return Deferred(jax.device_put(region, target))
    region.copy_to_host_async()
    return Deferred(region)


def fetch(data: jax.Array, part: tuple[slice, ...] | None) -> np.ndarray:
    """Host bytes of ``data[part]``, fetched :data:`FETCH_PIECE` bytes of rows at a time."""
    region = data if part is None else data[part]
    shape = tuple(region.shape)
    if not shape or region.nbytes <= FETCH_PIECE or shape[0] <= 1:
        return np.asarray(region)
    out = np.empty(shape, np.dtype(region.dtype))
    rows = max(1, FETCH_PIECE // max(1, region.nbytes // shape[0]))
    for lo in range(0, shape[0], rows):
        out[lo : lo + rows] = np.asarray(region[lo : lo + rows])
    return out


@dataclasses.dataclass(slots=True, eq=False)
class OnDevice(Deferred):
    """A region of a device copy, fetched when the writer gets to it."""

    part: tuple[slice, ...] | None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.part is None:
            return tuple(self.array.shape)
        return tuple(
            len(range(*s.indices(n))) for s, n in zip(self.part, self.array.shape, strict=False)
        ) + tuple(self.array.shape[len(self.part) :])
