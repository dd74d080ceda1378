"""The layout of a Hugging Face shard set from the global paths, dtypes and shapes alone:
every process computes the same layout without exchanging a byte. Pure; any thread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..._base import shown as _shown
from ..._errors import StructureError
from ..safetensors.headers import (
    DEFAULT_STEM,
    INDEX_SUFFIX,
    MARKER_KEY,
    MARKER_VALUE,
    default_names,
    packed_bits,
)
from ..safetensors.plan import Tensor, checked_name, encode_header, split_shards, tensor_dtype
from .key_maps import KeyMap

__all__ = ["Layout", "Placed", "plan"]

INDEX_NAME = DEFAULT_STEM + INDEX_SUFFIX


@dataclasses.dataclass(frozen=True)
class Placed:
    """A tensor and where its bytes go: file ``shard``, from absolute byte ``offset``."""

    tensor: Tensor
    shard: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every file of the set: names, headers (bytes, padded), sizes, and the tensors."""

    names: tuple[str, ...]
    headers: tuple[bytes, ...]
    sizes: tuple[int, ...]
    placed: dict[str, Placed]  # by leaf path
    total: int  # tensor bytes (the index's total_size)

    def index(self) -> dict:
        """The ``model.safetensors.index.json`` document."""
        return {
            "metadata": {"total_size": self.total, MARKER_KEY: MARKER_VALUE},
            "weight_map": {p.tensor.name: self.names[p.shard] for p in self.placed.values()},
        }


def _names(leaves: Sequence[tuple[str, np.dtype, tuple[int, ...]]], key_map: KeyMap | None):
    if key_map is None or not key_map.rules:  # fop.to_safetensors's rule, the one way back
        return _unique(default_names([path for path, _, _ in leaves]), default=True)
    names: dict[str, str] = {}
    unmatched = []
    for path, _, _ in leaves:
        matched, name = key_map.name(path)
        if not matched:
            unmatched.append(path)
        elif name is not None:
            names[path] = name
    if unmatched:
        raise StructureError(
            f"hf_shards key_map: {len(unmatched)} leaf path(s) match no rule: "
            f"{_shown.listed(unmatched, fmt=repr)}; map each to a tensor name, or to None to "
            f"leave it out on purpose"
        )
    if leaves and not names:
        raise StructureError(f"hf_shards key_map leaves out every leaf ({len(leaves)})")
    return _unique(names, default=False)


def _unique(names: dict[str, str], *, default: bool) -> dict[str, str]:
    """``names`` (``default``: the default names), each one a header can hold, none twice."""
    seen: dict[str, str] = {}
    for path, name in names.items():
        checked_name(path, name, default, "hf_shards key_map")
        if name in seen:
            raise StructureError(
                f"hf_shards key_map: leaves {seen[name]!r} and {path!r} both map to {name!r}"
            )
        seen[name] = path
    return names


def _tensor(path: str, name: str, dtype, shape, key_map: KeyMap | None, cast) -> Tensor:
    out = tensor_dtype(path, dtype, cast)
    if packed_bits(out) is not None:  # a process's rows need not fall on whole bytes
        raise StructureError(
            f"leaf {path!r}: {out} is packed below a byte in safetensors; hf_shards takes "
            f"byte-sized dtypes only: cast it (HFShards(dtype='bfloat16')) or leave it out"
        )
    axes = None
    if key_map is not None and key_map.transposed(path):
        if len(shape) < 2:
            raise StructureError(
                f"leaf {path!r}: transposes names it, but it has shape {tuple(shape)} "
                f"(expected at least 2 axes)"
            )
        n = len(shape)
        axes = (n - 1, n - 2, *range(n - 2))
    out_shape = tuple(shape[a] for a in axes) if axes else tuple(shape)
    return Tensor(path, name, out, out_shape, axes)


def plan(
    leaves: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
    key_map: KeyMap | None,
    max_shard_bytes: int,
    dtype=None,
    metadata: dict[str, str] | None = None,
) -> Layout:
    """The layout of ``leaves`` (global path, dtype, shape), in their order."""
    names = _names(leaves, key_map)
    tensors = [
        _tensor(path, names[path], dt, shape, key_map, dtype)
        for path, dt, shape in leaves
        if path in names
    ]
    shards = split_shards(tensors, max_shard_bytes)
    count = len(shards)
    files = tuple(f"{DEFAULT_STEM}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1))
    meta = {"format": "pt", **(metadata or {}), MARKER_KEY: MARKER_VALUE}
    headers, sizes, placed = [], [], {}
    for i, shard in enumerate(shards):
        header = encode_header(shard, meta)
        offset = len(header)
        for t in shard:
            placed[t.path] = Placed(t, i, offset)
            offset += t.nbytes
        headers.append(header)
        sizes.append(offset)
    total = sum(t.nbytes for t in tensors)
    return Layout(files, tuple(headers), tuple(sizes), placed, total)
