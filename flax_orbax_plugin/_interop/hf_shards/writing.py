"""What one process writes of a Hugging Face shard set: its regions, at their offsets.
``snapshot`` runs on the training thread; ``Pending`` writes on a background thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._interop.hf_shards.writing``.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ..._base import distributed as _distributed
from ..._base import env as _env
from ..._core.formats import Written
from ..._core.handle import raise_if_cancelled
from ..._errors import StructureError
from ..._format import layout as _layout
from ..._like import onto_like as _onto_like
from ..._manager.checkpointables import encode_json, write_json
from ..._storage.location import Location
from ..safetensors.headers import runs
from ..safetensors.plan import tensor_bytes
from .layout import INDEX_NAME, Layout

__all__ = ["Pending", "snapshot"]

CONFIG_NAME = "config.json"


def _box(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def snapshot(layout: Layout, values: Mapping[str, Any]) -> list[tuple[str, tuple, np.ndarray]]:
    """This process's regions ``(leaf path, box in the leaf, host copy)``: device copies
    started for all, then waited for; one leaf's regions filling a box share a buffer."""
    primary = _distributed.is_primary()
    pending = []
    for path in layout.placed:
        value = values[path]
        if isinstance(value, jax.Array):
            shape = tuple(value.shape)
            parts = [
                (_box(shard.index, shape), shard.data)
                for shard in value.addressable_shards
                if shard.replica_id == 0
            ]
            for _, data in parts:
                data.copy_to_host_async()
            pending.append((path, parts))
        elif primary:
            arr = np.asarray(value)
            pending.append((path, [(tuple(slice(0, n) for n in arr.shape), arr)]))
    return [region for path, parts in pending for region in _merged(path, parts)]


def _volume(box: tuple) -> int:
    return math.prod(s.stop - s.start for s in box)


def _merged(path: str, parts: list) -> list[tuple[str, tuple, np.ndarray]]:
    """Host copies of one leaf's regions: one buffer when they fill their box, else each."""
    if len(parts) > 1:
        boxes = [box for box, _ in parts]
        bound = tuple(
            slice(min(b[a].start for b in boxes), max(b[a].stop for b in boxes))
            for a in range(len(boxes[0]))
        )
        if sum(_volume(b) for b in boxes) == _volume(bound):
            out = np.empty([s.stop - s.start for s in bound], dtype=parts[0][1].dtype)
            for box, data in parts:
                rel = tuple(
                    slice(b.start - o.start, b.stop - o.start)
                    for b, o in zip(box, bound, strict=True)
                )
                out[rel] = np.asarray(data)
            return [(path, bound, out)]
    return [(path, box, np.array(data, copy=True)) for box, data in parts]


def _bytes_of(layout: Layout, path: str, box: tuple, data: np.ndarray) -> tuple[tuple, np.ndarray]:
    """The region as written: its box in the tensor and its bytes."""
    t = layout.placed[path].tensor
    if data.dtype != t.dtype:  # rounding is the opt-in; an overflow (1e5 to inf) is not
        try:
            _onto_like.check(path, np.asarray(data), t.dtype, cast="safe")
        except StructureError as e:  # HFShards has no cast=: its own way out
            advice = "export that leaf in another dtype (bfloat16) or leave it out (key_map)"
            raise StructureError(f"HFShards: {_onto_like.with_advice(e, advice)}") from None
        data = data.astype(t.dtype)  # checked: tensor_bytes need not check it again
    box = box if t.axes is None else tuple(box[a] for a in t.axes)
    return box, tensor_bytes(t, data, tuple(s.stop - s.start for s in box))


class _LocalFile:
    """One shard file on local disk, opened to be written at offsets."""

    def __init__(self, path: str, size: int):
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(path, flags, 0o644)
        os.ftruncate(self.fd, size)

    def write(self, offset: int, data: memoryview) -> None:
        while data:
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

    def close(self) -> None:
        os.close(self.fd)


class _MemoryFile:
    """One shard file of an object store, assembled in memory, written whole."""

    def __init__(self, directory: Location, name: str, size: int):
        self.directory, self.name, self.buf = directory, name, bytearray(size)

    def write(self, offset: int, data: memoryview) -> None:
        self.buf[offset : offset + len(data)] = data

    def close(self) -> None:
        self.directory.write_bytes(self.name, bytes(self.buf), durable=False)
        self.buf = bytearray()


class Pending:
    """A thread started when made writes this process's bytes; :meth:`wait` joins it."""

    def __init__(
        self,
        directory: Location,
        layout: Layout,
        regions: list,
        config: Mapping[str, Any] | None,
        cancelled: threading.Event | None,
    ):
        self.directory, self.layout, self.config = directory, layout, config
        self.cancelled = cancelled or threading.Event()
        where = f"{directory}/{INDEX_NAME}"
        self.index = encode_json(layout.index(), where)  # refused now if too large
        self.digest = _layout.sha256(self.index)  # every process computed the same layout
        self._result: Written | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(regions,), name="fop-hf-shards", daemon=True
        )
        self._thread.start()

    def _run(self, regions: list) -> None:
        try:
            self._result = self._write(regions)
        except BaseException as e:  # noqa: BLE001  (re-raised by wait, on the manager's thread)
            self._error = e

    def wait(self) -> Written:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def _write(self, regions: list) -> Written:
        layout, primary = self.layout, _distributed.is_primary()
        by_shard: dict[int, list] = {}
        for path, box, data in regions:
            by_shard.setdefault(layout.placed[path].shard, []).append((path, box, data))
        local = self.directory.is_local
        if local:
            os.makedirs(self.directory.path, exist_ok=True)
        written = 0
        for i, name in enumerate(layout.names):
            mine = by_shard.pop(i, [])
            if not mine and not primary:
                continue
            raise_if_cancelled(self.cancelled, f"hf_shards {self.directory}")
            if local:
                f = _LocalFile(os.path.join(self.directory.path, name), layout.sizes[i])
            else:
                f = _MemoryFile(self.directory, name, layout.sizes[i])
            try:
                if primary:
                    f.write(0, memoryview(layout.headers[i]))
                for path, box, data in mine:
                    written += self._region(f, path, box, data)
                    _env.fail_point("hf_shards_write")
            finally:
                f.close()
        files = {}
        if primary:
            files.update(write_json(self.directory, INDEX_NAME, self.index).files)
            if self.config is not None:
                raw = encode_json(dict(self.config), f"{self.directory}/{CONFIG_NAME}")
                files.update(write_json(self.directory, CONFIG_NAME, raw).files)
        return Written(written, files)

    def _region(self, f: Any, path: str, box: tuple, data: np.ndarray) -> int:
        placed = self.layout.placed[path]
        box, raw = _bytes_of(self.layout, path, box, data)
        view, item = memoryview(raw), placed.tensor.dtype.itemsize
        pos = 0
        for first, count in runs(placed.tensor.shape, box):
            f.write(placed.offset + first * item, view[pos : pos + count * item])
            pos += count * item
        return pos
