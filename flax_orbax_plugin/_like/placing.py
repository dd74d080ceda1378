"""Placing a foreign reader's leaf onto ``like``: an importer calls :func:`plan` per leaf
(raising before anything is read), then :func:`materialize`. No state; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.placing``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._errors import StructureError
from .onto_like import _is_float, check, describe, is_key_dtype, is_lossless, template_of

Reader = Callable[[tuple[slice, ...]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """What one leaf becomes: checked before any byte is read."""

    path: str
    shape: tuple[int, ...]
    stored_dtype: np.dtype
    out_dtype: np.dtype
    like: Any
    python_scalar: bool  # like None and the source stored a Python scalar
    key_impl: Any = None  # like is a PRNG key array: wrap the stored key data
    check_values: bool = False  # a narrowing cast: allowed only if no value changes
    source: str = ""
    rounds: bool = False  # dtype= asked for a narrower float: it may round, never overflow

    def cast(self, data: np.ndarray) -> np.ndarray:
        """``data`` in ``out_dtype``; a checked cast follows ``onto_like.check`` and changes
        no value at all (a float may round where ``rounds``), else StructureError."""
        if data.dtype == self.out_dtype:
            return data
        if self.check_values:
            try:
                check(self.path, data, self.out_dtype, cast="safe")
            except StructureError as e:
                raise StructureError(f"{e} (in {self.source})") from None
        with np.errstate(all="ignore"):  # unchecked: numpy's cast, as asked
            out = data.astype(self.out_dtype)
        if self.check_values and not self.rounds:
            back = out.astype(data.dtype)
            same = back == data
            if _is_float(data.dtype) or data.dtype.kind == "c":
                same |= np.isnan(data) & np.isnan(back)
            if not same.all():
                raise StructureError(
                    f"leaf {self.path!r}: dtype mismatch: expected {self.out_dtype} "
                    f"(from like), found {data.dtype} in {self.source}, and casting changes "
                    f"values (pass cast='unsafe' to cast anyway)"
                )
        return out


def plan(
    path: str,
    shape: tuple[int, ...],
    dtype: Any,
    like: Any,
    *,
    source: str,
    allow_cast: bool = False,
    python_scalar: bool = False,
    rounds: bool = False,
) -> LeafPlan:
    """Checks that the stored ``shape``/``dtype`` fit ``like`` (StructureError naming the
    leaf); ``source``: the file; ``rounds``: a checked cast may round a float (never
    overflow)."""
    shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
    if like is None:
        return LeafPlan(path, shape, dtype, dtype, None, python_scalar)
    like_shape, like_dtype = template_of(path, like)
    if is_key_dtype(like_dtype):
        impl = getattr(like_dtype, "_impl", None)
        key_shape = like_shape + tuple(getattr(impl, "key_shape", ()))
        if impl is None or key_shape != shape or dtype != np.uint32:
            raise StructureError(
                f"leaf {path!r}: expected key data for {describe(like)} (from like), "
                f"found {dtype}{list(shape)} in {source}"
            )
        return LeafPlan(path, shape, dtype, dtype, like, False, impl)
    if like_shape != shape:
        raise StructureError(
            f"leaf {path!r}: shape mismatch: expected {like_shape} (from like), "
            f"found {shape} in {source}"
        )
    like_dtype = np.dtype(like_dtype)
    checked = not allow_cast and not is_lossless(dtype, like_dtype)
    return LeafPlan(path, shape, dtype, like_dtype, like, False, None, checked, source, rounds)


def materialize(leaf: LeafPlan, read: Reader) -> Any:
    """Reads the leaf through ``read(index)`` and returns it in the form of ``like``."""
    like = leaf.like
    whole = tuple(slice(0, s) for s in leaf.shape)
    if leaf.key_impl is not None:
        keys = jax.random.wrap_key_data(np.asarray(read(whole)), impl=leaf.key_impl)
        sharding = getattr(like, "sharding", None)  # (like passed template_of)
        return jax.device_put(keys, sharding) if sharding is not None else keys
    if like is None:
        data = np.asarray(read(whole))
        return data[()].item() if leaf.python_scalar else data
    if isinstance(like, (bool, int, float, complex)):
        return type(like)(leaf.cast(np.asarray(read(whole)))[()])
    if isinstance(like, np.generic):
        return leaf.cast(np.asarray(read(whole)))[()]
    if isinstance(like, np.ndarray):
        return leaf.cast(np.asarray(read(whole)))
    sharding = getattr(like, "sharding", None)  # (like passed template_of)
    if sharding is None:
        return jax.device_put(leaf.cast(np.asarray(read(whole))), jax.devices()[0])
    size = int(np.prod(leaf.shape, dtype=np.int64))
    if sharding.is_fully_replicated or size == 0:
        return jax.device_put(leaf.cast(np.asarray(read(whole))), sharding)
    by_index: dict[tuple, list] = collections.defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        index = tuple(
            slice(*s.indices(dim)[:2]) if isinstance(s, slice) else s
            for s, dim in zip(index, leaf.shape, strict=True)
        )
        by_index[tuple((s.start, s.stop) for s in index)].append((device, index))
    pieces = []
    for devices in by_index.values():
        data = leaf.cast(np.asarray(read(devices[0][1])))
        pieces.extend(jax.device_put(data, device) for device, _ in devices)
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, pieces)
