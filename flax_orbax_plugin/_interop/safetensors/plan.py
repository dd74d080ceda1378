"""An export's plan: each leaf's tensor (name, dtype, layout), its bytes, its shard,
and the export's options checked. Pure functions: no file is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..._base import shown as _shown
from ..._base.env import Option, found
from ..._core.formats import MEMORY_LIMIT
from ..._errors import OptionError, OptionTypeError, StructureError
from ..._like import onto_like as _onto_like
from ..._zarr.subbyte import pack_rows
from .headers import (
    METADATA_KEY,
    TAGS,
    default_name,
    default_names,
    kernel_axes,
    packed_bits,
    tensor_nbytes,
)

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*(?:(?:([KMGT])(I)?)?B)?\s*$", re.IGNORECASE)


def parse_size(size: int | str, option: str = "max_shard_size") -> int:
    """Bytes in a size such as ``5GB`` (10**9, as Hugging Face counts) or ``2MiB`` (2**20)."""
    value = None
    if isinstance(size, str):
        if m := _SIZE_RE.match(size):  # KB: 10**3, KiB: 2**10 ... TiB: 2**40
            power = " KMGT".index((m.group(2) or " ").upper())
            value = int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)
    elif not isinstance(size, bool):
        with contextlib.suppress(TypeError):
            value = operator.index(size)
    if value is None:
        raise OptionError(
            f"{option} (the max shard size): expected bytes or a size such as '5GB', "
            f"'500MB', '2GiB', found {found(size)}"
        )
    if value <= 0:
        raise OptionError(
            f"{option} (the max shard size): expected a positive size, found {size!r}"
        )
    return value


def checked_cast(dtype: Any, option: str = "dtype", *, byte_sized: bool = False):
    """``dtype=`` of an export or of ``HFShards``: None, or a floating dtype safetensors
    has a tag for (``byte_sized``: not packed below a byte), as numpy's."""
    try:
        out = _onto_like.checked_dtype(dtype)
    except (OptionError, OptionTypeError) as e:
        text = str(e).removeprefix("dtype: ")
        raise type(e)(f"{option}: {text}") from None
    if out is None:
        return None
    out = np.dtype(out)
    if out not in TAGS:
        floats = sorted(str(d) for d in TAGS if _onto_like._is_float(d))
        raise OptionError(
            f"{option}: {out} has no safetensors equivalent (expected one of {floats})"
        )
    if byte_sized and packed_bits(out) is not None:
        raise OptionError(
            f"{option}: {out} is packed below a byte in safetensors; hf_shards writes each "
            f"process's rows at their byte offsets, so it takes byte-sized dtypes only "
            f"(e.g. 'bfloat16')"
        )
    return out


def checked_metadata(metadata: Any) -> dict[str, str] | None:
    """``metadata=`` (the header's ``__metadata__``): None or a mapping of str to str."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise OptionTypeError(
            f"metadata: expected a dict of str to str (the header's __metadata__), found "
            f"{found(metadata)}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise OptionTypeError(
                f"metadata: expected a dict of str to str (safetensors stores text only), "
                f"found the entry {key!r:.60}: {found(value)}"
            )
    return dict(metadata)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor to write: a leaf of the source as it goes into the files."""

    path: str  # leaf path in the source
    name: str  # tensor name in the files
    dtype: np.dtype  # written dtype
    shape: tuple[int, ...]  # written shape (after any transpose)
    axes: tuple[int, ...] | None  # transpose applied on write
    cast: str = "safe"  # a dtype cast: "safe" (values kept, floats rounded) or "unsafe"

    @property
    def nbytes(self) -> int:
        """Bytes in the file (sub-byte dtypes packed; plan_tensors refused partial bytes)."""
        return tensor_nbytes(self.dtype, math.prod(self.shape)) or 0


def encode_header(tensors: Sequence[Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {METADATA_KEY: metadata} if metadata else {}
    offset = 0
    for t in tensors:
        checked_name(t.path, t.name, False, "tensor name")  # planned names were checked
        header[t.name] = {
            "dtype": TAGS[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def split_shards(tensors: list[Tensor], limit: int) -> list[list[Tensor]]:
    """Greedy, in order, as Hugging Face does (a tensor above the limit alone)."""
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


class ListedKeyMap:
    """A key map ``{leaf path: tensor name or None}``; others keep their default name."""

    def __init__(self, mapping: dict[str, str | None], where: str):
        self.mapping, self.where = mapping, where

    def __call__(self, path: str) -> str | None:
        return self.mapping.get(path, default_name(path))

    def check(self, paths: list[str]) -> None:
        unknown = sorted(set(self.mapping) - set(paths))
        if unknown:
            raise OptionError(
                f"{self.where}: names {len(unknown)} leaf path(s) the source does not have: "
                f"{_shown.listed(unknown, limit=6, fmt=repr)}; its leaves: "
                f"{_shown.listed(paths, limit=6, fmt=repr, empty='none')}"
            )


FLAGS = tuple(Option(name, "flag") for name in ("transpose_kernels", "partial"))
EXPORT_OPTIONS = (*FLAGS, Option("force", "flag"), Option("progress", "callable", none_ok=True))
EXPORT_OPTIONS += (MEMORY_LIMIT,)


def refuse_over_limit(tensors: list[Tensor], limit: int | None) -> None:
    """OptionError for a leaf larger than the ceiling ``limit`` (an export holds one)."""
    if limit is None:
        return
    big = max(tensors, key=lambda t: t.nbytes, default=None)
    if big is not None and big.nbytes > limit:
        raise OptionError(
            f"memory_limit_bytes={limit}: leaf {big.path!r} holds {big.nbytes} bytes, and an "
            f"export holds one whole leaf; nothing was written: give memory_limit_bytes >= "
            f"{big.nbytes} (or None)"
        )


def checked_key_map(key_map: Any) -> Callable[[str], str | None] | None:
    """``key_map=``: None, a function, or a mapping (as a :class:`ListedKeyMap`)."""
    if key_map is None or isinstance(key_map, ListedKeyMap):
        return key_map
    if isinstance(key_map, Mapping):
        named = lambda v: v is None or isinstance(v, str)
        bad = [k for k, v in key_map.items() if not isinstance(k, str) or not named(v)]
        if bad:
            raise OptionTypeError(
                f"key_map: expected {{leaf path: tensor name or None}}, found the entry "
                f"{bad[0]!r:.60}: {key_map[bad[0]]!r:.60}"
            )
        return ListedKeyMap(dict(key_map), "key_map")
    if callable(key_map):
        return key_map
    raise OptionTypeError(
        f"key_map: expected a function (leaf path -> tensor name or None) or a mapping, "
        f"found {type(key_map).__name__} {key_map!r:.60}"
    )


def checked_name(path: str, name: Any, default: bool, option: str = "key_map") -> str:
    """``name``, the tensor name of leaf ``path``, checked as ``safetensors`` would
    (``default``: a default name, a StructureError; else ``option``'s OptionError)."""
    if not isinstance(name, str) or not name:
        fault = f"expected a tensor name (a non-empty str), found {name!r:.80}"
    elif name == METADATA_KEY:
        fault = (
            f"{METADATA_KEY!r} is the safetensors header's metadata entry, not a tensor name "
            f"(safetensors refuses a file holding a tensor of that name)"
        )
    elif any("\ud800" <= c <= "\udfff" for c in name):  # a lone surrogate: no UTF-8
        fault = f"the tensor name {name!r:.80} cannot be written as UTF-8"
    else:
        return name
    if default:
        raise StructureError(
            f"leaf {path!r}: its tensor name {name!r:.80} cannot be written: {fault}; "
            f"name it otherwise with {option} (e.g. {{{path!r}: 'metadata'}})"
        )
    raise OptionError(f"{option}: leaf {path!r}: {fault}")


def tensor_dtype(path: str, leaf_dtype, cast) -> np.dtype:
    """The dtype leaf ``path`` is written as: its own, or ``cast`` for a floating leaf."""
    out = np.dtype(leaf_dtype)
    if cast is not None and _onto_like._is_float(out):
        out = np.dtype(cast)
    if out not in TAGS:
        raise StructureError(
            f"leaf {path!r}: dtype {out} has no safetensors equivalent "
            f"(expected one of {sorted(str(d) for d in TAGS)})"
        )
    return out


def plan_tensors(
    leaves: list[tuple[str, np.dtype, tuple[int, ...]]],
    key_map: Callable[[str], str | None] | None,
    transpose_kernels: bool,
    dtype: Any,
    cast: str = "safe",
) -> list[Tensor]:
    if isinstance(key_map, ListedKeyMap):
        key_map.check([path for path, _, _ in leaves])
    names = {}
    defaults = default_names([path for path, _, _ in leaves])
    for path, _, _ in leaves:
        name = defaults[path] if key_map is None else key_map(path)
        if name is not None:
            checked_name(path, name, key_map is None or name == default_name(path))
            names[path] = name
    if leaves and not names:
        raise OptionError(
            f"key_map leaves out every leaf ({len(leaves)}): nothing would be exported"
        )
    seen: dict[str, str] = {}
    tensors = []
    for path, leaf_dtype, shape in leaves:
        if path not in names:
            continue
        name = names[path]
        if name in seen:
            raise OptionError(f"key_map: leaves {seen[name]!r} and {path!r} both map to {name!r}")
        seen[name] = path
        out_dtype = tensor_dtype(path, leaf_dtype, dtype)
        bits = packed_bits(out_dtype)
        if bits is not None and math.prod(shape) * bits % 8:
            raise StructureError(
                f"leaf {path!r}: {math.prod(shape)} values of {out_dtype} are "
                f"{math.prod(shape) * bits} bits; safetensors {TAGS[out_dtype]} packs them "
                "into whole bytes only (a count times its bits a multiple of 8)"
            )
        axes = kernel_axes(path, len(shape), transpose_kernels)
        out_shape = tuple(shape[a] for a in axes) if axes else tuple(shape)
        tensors.append(Tensor(path, name, out_dtype, out_shape, axes, cast))
    return tensors


def tensor_bytes(t: Tensor, value: Any, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The bytes of ``value`` as ``t`` is written: cast, transposed, little-endian, packed."""
    arr = np.asarray(value)
    if arr.dtype != t.dtype:  # a value the cast would change: StructureError naming it
        _onto_like.check(t.path, arr, t.dtype, cast=t.cast)
        with np.errstate(all="ignore"):  # "unsafe": numpy's cast, as asked
            arr = arr.astype(t.dtype)
    if t.axes is not None:
        arr = arr.transpose(t.axes)
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a scalar 1-D)
        arr = arr.copy(order="C")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    want = t.shape if shape is None else shape
    if tuple(arr.shape) != want:
        raise StructureError(
            f"leaf {t.path!r}: expected shape {want} for tensor {t.name!r}, found {arr.shape}"
        )
    bits = packed_bits(arr.dtype)
    return arr.reshape(-1).view(np.uint8) if bits is None else pack_rows(arr.reshape(-1), bits)
