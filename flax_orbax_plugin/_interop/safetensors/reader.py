"""Reading safetensors straight onto ``like``: :func:`from_safetensors`. Every header is
validated first; each process reads only the regions its devices hold. Collective-free.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..._base import tree as _tree
from ..._base.env import check
from ..._core import reads as _reads
from ..._core.formats import MEMORY_LIMIT
from ..._errors import CorruptCheckpointError, OptionError, StructureError
from ..._like import placing as _placing
from ..._like.onto_like import legacy_cast
from ..._storage.untrusted import open_regular
from ..._zarr.subbyte import group, unpack_rows
from .headers import (
    Stored,
    default_names,
    kernel_axes,
    packed_bits,
    pread_into,
    read_safetensors_index,
    runs,
)
from .plan import FLAGS, checked_key_map, checked_name


def _read_region(fd: int, t: Stored, index: tuple[slice, ...]) -> np.ndarray:
    """The region ``index`` (unit-step slices) of a stored tensor, nothing outside it read."""
    starts = [s.indices(d)[0] for s, d in zip(index, t.shape, strict=True)]
    stops = [s.indices(d)[1] for s, d in zip(index, t.shape, strict=True)]
    bits = packed_bits(t.dtype)
    if bits is not None:
        return _read_packed(fd, t, bits, starts, stops)
    out = np.empty([max(0, b - a) for a, b in zip(starts, stops, strict=True)], t.dtype)
    buf, pos = memoryview(out.reshape(-1).view(np.uint8)), 0
    item, where = t.dtype.itemsize, f"{t.file} ({t.name})"
    box = [slice(a, b) for a, b in zip(starts, stops, strict=True)]
    for first, count in runs(t.shape, box):  # one pread per contiguous run
        pread_into(fd, buf[pos : pos + count * item], t.offset + first * item, where)
        pos += count * item
    return out


def _read_packed(fd: int, t: Stored, bits: int, starts: list, stops: list) -> np.ndarray:
    """A region of a packed tensor: the rows of axis 0 it spans read, unpacked, cut."""
    shape = t.shape
    if any(b <= a for a, b in zip(starts, stops, strict=True)):
        return np.empty([max(0, b - a) for a, b in zip(starts, stops, strict=True)], t.dtype)
    row = math.prod(shape[1:])  # elements per row of axis 0 (a 0-d tensor: one element)
    lo, hi = (starts[0], stops[0]) if shape else (0, 1)
    first = lo * row - lo * row % group(bits)  # the group (of whole bytes) it starts in
    raw = np.empty(-(-hi * row * bits // 8) - first * bits // 8, np.uint8)
    pread_into(fd, memoryview(raw), t.offset + first * bits // 8, f"{t.file} ({t.name})")
    values = unpack_rows(raw, bits, (hi - lo) * row, lo * row - first, np.uint8).view(t.dtype)
    rows = values.reshape((hi - lo, *shape[1:]) if shape else ())
    if not shape:
        return rows
    cut = (slice(None), *(slice(a, b) for a, b in zip(starts[1:], stops[1:], strict=True)))
    return np.ascontiguousarray(rows[cut])


class _Files:
    """Open file descriptors of the tensors' files, closed together."""

    def __init__(self):
        self.fds: dict[str, int] = {}

    def reader(self, t: Stored, axes: tuple[int, ...] | None) -> Callable:
        """read(index) in the leaf's layout (transposed back from PyTorch's if ``axes``)."""
        if t.file not in self.fds:
            fd, st = open_regular(t.file, follow_links=True, what="safetensors file")
            if (st.st_dev, st.st_ino, st.st_size) != t.identity:
                os.close(fd)
                raise CorruptCheckpointError(
                    f"{t.file}: changed (replaced or resized) after its header was read; "
                    f"read it again"
                )
            self.fds[t.file] = fd
        fd = self.fds[t.file]
        if axes is None:
            return lambda index: _read_region(fd, t, tuple(index))
        perm = [int(i) for i in np.argsort(axes)]  # leaf axis j is stored axis perm[j]

        def read(index):
            stored = [slice(None)] * len(index)
            for j, s in enumerate(index):
                stored[perm[j]] = s
            return _read_region(fd, t, tuple(stored)).transpose(perm)

        return read

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def from_safetensors(
    paths_or_index: Any,
    like: Any = None,
    *,
    key_map: Callable[[str], str | None] | None = None,
    transpose_kernels: bool = False,
    partial: bool = False,
    cast: str = "safe",
    allow_cast: bool | None = None,
    memory_limit_bytes: int | None = None,
) -> Any:
    """Reads safetensors straight onto the shardings of ``like``.

    One leaf is read at a time (on a sharded ``like``, one region of it at a time), so
    what this holds beyond the result is the host copy of one piece and its cast.

    Args:
      paths_or_index: a ``.safetensors`` file, a list of them, a
        ``*.safetensors.index.json`` or a directory holding ``model.safetensors``
        or ``model.safetensors.index.json``.
      like: a pytree of arrays / ``jax.ShapeDtypeStruct`` (with shardings: each
        process reads only the regions its devices hold), numpy arrays or scalars;
        None gives ``{tensor name: numpy array}``.
      key_map: leaf path -> tensor name (a function, or a mapping of the leaves it
        names), as for export (default: '/' replaced by '.').
      transpose_kernels: the files hold kernels in PyTorch's layout (see export).
      partial: allow tensors in the files that ``like`` does not use.
      cast: ``"safe"`` (a cast that would change a value is a StructureError naming
        the leaf) or ``"unsafe"`` (numpy's cast), as ``fop.restore`` takes it.
      allow_cast: deprecated (``allow_cast=True`` is ``cast="unsafe"``).
      memory_limit_bytes: the host-memory ceiling (None: no bound): a leaf whose piece
        read to host (and its cast, where the dtype changes) is larger is refused,
        naming the leaf and both figures, before any byte is read. A piece read
        straight into the result (``like`` None or numpy, no cast) holds nothing more.

    Raises:
      StructureError: a leaf of ``like`` has no tensor, a shape differs, a cast would
        change a value, or (without ``partial``) a tensor is left unused.
      CorruptCheckpointError: a header or index is malformed (names the file).
    """
    key_map = checked_key_map(key_map)  # a mapping as the exporter takes it
    check(FLAGS, {"transpose_kernels": transpose_kernels, "partial": partial})
    limit = check((MEMORY_LIMIT,), {"memory_limit_bytes": memory_limit_bytes})[MEMORY_LIMIT.name]
    allow_cast = legacy_cast(cast, allow_cast, where="from_safetensors") == "unsafe"
    stored = read_safetensors_index(paths_or_index)
    files = _Files()
    try:
        return _read_onto(
            stored,
            paths_or_index,
            like,
            files,
            key_map,
            transpose_kernels,
            partial,
            allow_cast,
            limit,
        )
    finally:
        files.close()


def _read_onto(
    stored, paths_or_index, like, files, key_map, transpose_kernels, partial, allow_cast, limit
):
    if like is None:  # each tensor read straight into the result: nothing more held
        return {
            name: files.reader(t, None)(tuple(slice(None) for _ in t.shape))
            for name, t in stored.items()
        }
    flat, treedef = _tree.flatten(like)
    used: set[str] = set()
    plans = []
    defaults = default_names([path for path, _, _ in flat])  # as the export named them
    for path, _, leaf_like in flat:
        name = defaults[path] if key_map is None else key_map(path)
        if name is not None:  # '__metadata__' is no tensor: say so, not "no such tensor"
            checked_name(path, name, key_map is None)
        t = stored.get(name) if name is not None else None
        if t is None:
            raise StructureError(
                f"leaf {path!r}: expected tensor {name!r}, found no such tensor in {paths_or_index}"
            )
        used.add(name)
        axes = kernel_axes(path, len(t.shape), transpose_kernels)
        shape = tuple(t.shape[i] for i in np.argsort(axes)) if axes else t.shape
        plan = _placing.plan(
            path,
            shape,
            t.dtype,
            leaf_like,
            source=f"{t.file} ({name})",
            allow_cast=allow_cast,
        )
        plans.append((plan, t, axes))
    unused = sorted(set(stored) - used)
    if unused and not partial:
        raise StructureError(
            f"tensor {unused[0]!r}: found in {paths_or_index} but no leaf of like maps to it"
            + (f" ({len(unused) - 1} more)" if len(unused) > 1 else "")
            + "; pass partial=True to read a subset"
        )
    _check_placeable(plans)  # before a byte is read
    _refuse_over_limit(plans, limit)
    values = []
    for plan, t, axes in plans:
        values.append(_placing.materialize(plan, files.reader(t, axes)))
        if limit is not None:  # a transfer keeps its host copy alive until it is done:
            jax.block_until_ready(values[-1])  # one at a time under a ceiling
    return jax.tree_util.tree_unflatten(treedef, values)


def held_bytes(plan: _placing.LeafPlan) -> int:
    """Host bytes reading ``plan``'s leaf holds beyond the result, at most."""
    like = plan.like
    stored, out = plan.stored_dtype.itemsize, plan.out_dtype.itemsize
    cast = plan.out_dtype != plan.stored_dtype
    on_host = like is None or isinstance(like, (np.ndarray, np.generic, bool, int, float, complex))
    if on_host and plan.key_impl is None:
        return math.prod(plan.shape) * (stored + out) if cast else 0
    sharding = getattr(like, "sharding", None)
    piece = math.prod(plan.shape)
    if sharding is not None and not sharding.is_fully_replicated and piece:
        pieces = sharding.addressable_devices_indices_map(plan.shape).values()
        piece = max(
            math.prod(len(range(*s.indices(d))) for s, d in zip(index, plan.shape, strict=True))
            for index in pieces
        )
    return piece * (stored + (out if cast else 0))


def _refuse_over_limit(plans: list, limit: int | None) -> None:
    """OptionError for a leaf whose read holds more than ``limit`` (:func:`held_bytes`)."""
    if limit is None:
        return
    held, path = max(((held_bytes(p), p.path) for p, _, _ in plans), default=(0, ""))
    if held > limit:
        raise OptionError(
            f"memory_limit_bytes={limit}: leaf {path!r}: reading it holds {held} bytes of "
            f"host memory; nothing was read: give memory_limit_bytes >= {held} (or None)"
        )


def _check_placeable(plans: list) -> None:
    """A StructureError, not jax's, for a dtype jax cannot place on a device (float6 on CPU)."""
    seen = set()
    for plan, _, _ in plans:
        if plan.key_impl is not None or not isinstance(
            plan.like, (jax.Array, jax.ShapeDtypeStruct)
        ):
            continue
        sharding = getattr(plan.like, "sharding", None)
        device = next(iter(sharding.device_set)) if sharding is not None else jax.devices()[0]
        if (plan.out_dtype, device) in seen:
            continue
        seen.add((plan.out_dtype, device))
        try:
            jax.device_put(np.zeros((), plan.out_dtype), device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise _reads.cannot_place(plan.path, plan.out_dtype, device.platform, e) from None
