"""The safetensors layout, read with trust checks: dtype table, names, headers, index,
each checked against the real file before anything sized by it is allocated (a symlink
is followed: the Hugging Face cache links each file). Rules: ``docs/safetensors.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..._errors import CheckpointNotFoundError, CorruptCheckpointError, OptionError
from ..._format import layout as _layout
from ..._storage.local_inputs import local_path
from ..._storage.untrusted import loads_json, open_regular, read_capped

INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_STEM = "model"
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_INDEX_BYTES = 64 << 20  # an index.json read into memory
# In the metadata of every file this library writes: only such a file is ever replaced.
MARKER_KEY = "flax_orbax_plugin"
MARKER_VALUE = "1"
SHARD_NAME_RE = r"{stem}(?:(?:-[0-9]{{5}}-of-[0-9]{{5}})?\.safetensors|\.safetensors\.index\.json)"
_MAX_NDIM = 64

# safetensors dtype tag <-> numpy dtype, from the package's one dtype table
DTYPES: dict[str, np.dtype] = {
    entry.safetensors: _layout.dtype_from_name(name)
    for name, entry in sorted(_layout.DTYPES.items())
    if entry.safetensors is not None
}
TAGS = {dtype: tag for tag, dtype in DTYPES.items()}
DTYPE_NAMES = frozenset(str(dtype) for dtype in DTYPES.values())  # 'bfloat16', 'bool' ...


def packed_bits(dtype: np.dtype) -> int | None:
    """The bits per value of a dtype safetensors stores packed; None for whole bytes."""
    entry = _layout.DTYPES.get(dtype.name)
    return entry.bits if entry is not None and entry.bits < 8 else None


def tensor_nbytes(dtype: np.dtype, count: int) -> int | None:
    """Bytes of ``count`` values of ``dtype``; None where packed values are no whole bytes."""
    bits = packed_bits(dtype)
    if bits is None:
        return count * dtype.itemsize
    return None if count * bits % 8 else count * bits // 8


METADATA_KEY = "__metadata__"  # the header's entry of str -> str, never a tensor


def default_name(path: str) -> str:
    """The default tensor name of a leaf path: ``Dense_0/kernel`` -> ``Dense_0.kernel``."""
    return path.replace("/", ".")


def default_names(paths: list[str]) -> dict[str, str]:
    """Each leaf path's :func:`default_name`, or its full path where two collide."""
    names = {p: default_name(p) for p in paths}
    return names if len(set(names.values())) == len(names) else {p: p for p in paths}


def tree_of_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": x}`` as ``{"a": {"b": x}}`` (the inverse of :func:`default_name`); the
    flat dict where a name would be both a leaf and a folder, or has an empty part."""
    tree: dict[str, Any] = {}
    for name, value in tensors.items():
        *folders, leaf = name.split(".")
        node = tree
        for part in folders:
            node = node.setdefault(part, {})
            if not isinstance(node, dict) or not part:
                return dict(tensors)
        if not leaf or leaf in node:
            return dict(tensors)
        node[leaf] = value
    return tree


def kernel_axes(path: str, ndim: int, transpose: bool) -> tuple[int, ...] | None:
    """The permutation from Flax's kernel layout (..., in, out) to PyTorch's (out, in, ...)."""
    if not transpose or ndim < 2 or path.rsplit("/", 1)[-1] != "kernel":
        return None
    return (ndim - 1, ndim - 2, *range(ndim - 2))


def runs(shape: tuple[int, ...], box: Sequence[slice]) -> Iterator[tuple[int, int]]:
    """``(first element, element count)`` of each contiguous range ``box`` covers in a
    row-major tensor of ``shape``, in the box's own row-major order."""
    n = len(shape)
    if n == 0:
        yield 0, 1
        return
    starts = [s.start for s in box]
    stops = [s.stop for s in box]
    if any(b <= a for a, b in zip(starts, stops, strict=True)):
        return
    k = n - 1  # the axes after k are covered whole: one range spans them
    while k > 0 and starts[k] == 0 and stops[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[a + 1 :]) for a in range(n)]
    length = (stops[k] - starts[k]) * strides[k]
    for idx in itertools.product(*(range(starts[a], stops[a]) for a in range(k))):
        yield (
            sum(i * s for i, s in zip(idx, strides, strict=False)) + starts[k] * strides[k],
            length,
        )


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor of a file whose header was checked: where its bytes are."""

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute offset of the first byte in the file
    identity: tuple[int, int, int] = (0, 0, 0)  # (st_dev, st_ino, size) when the header was read


def plain_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and not os.path.isabs(name)
    )


def pread_into(fd: int, buf: memoryview, offset: int, where: str) -> None:
    """Fills ``buf`` from byte ``offset`` of ``fd``; CorruptCheckpointError at an early end."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{where}: file ended {len(buf) - done} bytes early")
        done += n


def pread_exact(fd: int, n: int, offset: int, path: str, what: str) -> bytearray:
    buf = bytearray(n)
    pread_into(fd, memoryview(buf), offset, f"{path} ({what})")
    return buf


def header_json(fd: int, size: int, path: str) -> tuple[int, Any]:
    """(header length, parsed header) of an open file of ``size`` bytes, its length checked."""
    if size < 8:
        raise CorruptCheckpointError(f"{path}: {size} bytes, too short for a safetensors file")
    n = int.from_bytes(pread_exact(fd, 8, 0, path, "header length"), "little")
    if n > min(_MAX_HEADER_BYTES, size - 8):
        raise CorruptCheckpointError(
            f"{path}: header length {n} exceeds the file ({size} bytes) or the "
            f"{_MAX_HEADER_BYTES}-byte limit"
        )
    header = loads_json(pread_exact(fd, n, 8, path, "header"), f"{path}: header")
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object")
    return n, header


def _read_header(path: str) -> dict[str, Stored]:
    fd, st = open_regular(path, follow_links=True, what="safetensors file")
    try:
        size = st.st_size
        n, header = header_json(fd, size, path)
    finally:
        os.close(fd)
    identity = (st.st_dev, st.st_ino, size)
    data_len = size - 8 - n
    out: dict[str, Stored] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{where}: expected an object, found {entry!r}")
        tag, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(tag, str) or tag not in DTYPES:
            raise CorruptCheckpointError(
                f"{where}: dtype {str(tag)[:100]!r} not supported (expected one of "
                f"{sorted(DTYPES)})"
            )
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_NDIM
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
        ):
            raise CorruptCheckpointError(
                f"{where}: shape {str(shape)[:200]} is not a list of at most {_MAX_NDIM} sizes"
            )
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CorruptCheckpointError(
                f"{where}: data_offsets {str(offsets)[:200]} outside the {data_len} data bytes"
            )
        dtype, count = DTYPES[tag], math.prod(shape)  # Python ints: never overflows
        need, span = tensor_nbytes(dtype, count), offsets[1] - offsets[0]
        if need is None:
            bits = count * packed_bits(dtype)
            raise CorruptCheckpointError(f"{where}: {tag}{shape} is {bits} bits, not whole bytes")
        if span != need:
            raise CorruptCheckpointError(
                f"{where}: {tag}{shape} needs {need} bytes, data_offsets span {span}"
            )
        spans.append((offsets[0], offsets[1], name))
        out[name] = Stored(name, path, dtype, tuple(shape), 8 + n + offsets[0], identity)
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CorruptCheckpointError(f"{path}: tensors {a!r} and {b!r} overlap")
    return out


def read_safetensors_index(paths_or_index: Any) -> dict[str, Stored]:
    """Every tensor of one file, several, an index or a directory, validated."""
    if isinstance(paths_or_index, (list, tuple)):
        if not paths_or_index:  # it read nothing and gave {}
            raise OptionError(
                f"paths_or_index: expected safetensors files (a file, a list of them, an "
                f"index or a directory), found an empty {type(paths_or_index).__name__}"
            )
        files = [local_path(p, what="safetensors file") for p in paths_or_index]
        index = None
    else:
        path = local_path(paths_or_index, what="safetensors source")
        if os.path.isdir(path):  # its index, else its one file
            names = (DEFAULT_STEM + INDEX_SUFFIX, DEFAULT_STEM + ".safetensors")
            found = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
            if not found:
                raise CheckpointNotFoundError(
                    f"{path}: no {DEFAULT_STEM}{INDEX_SUFFIX} or {DEFAULT_STEM}.safetensors in it"
                )
            path = found[0]
        if path.endswith(".json"):
            index = _read_index(path)
            directory = os.path.dirname(os.path.abspath(path))
            files = sorted({os.path.join(directory, f) for f in index.values()})
        else:
            files, index = [path], None
    stored: dict[str, Stored] = {}
    for f in files:
        for name, t in _read_header(f).items():
            if name in stored:
                raise CorruptCheckpointError(
                    f"tensor {name!r} is in both {stored[name].file} and {f}"
                )
            stored[name] = t
    if index is not None:
        for name, f in index.items():
            t = stored.get(name)
            if t is None or os.path.basename(t.file) != f:
                raise CorruptCheckpointError(
                    f"{paths_or_index}: index puts tensor {name!r} in {f}, which does not hold it"
                )
    return stored


def _read_index(path: str) -> dict[str, str]:
    raw = read_capped(
        path, follow_links=True, what="safetensors index file", max_bytes=MAX_INDEX_BYTES
    )
    doc = loads_json(raw, path)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{path}: expected an object with a 'weight_map'")
    for name, f in weight_map.items():
        if not isinstance(f, str) or not plain_name(f):
            raise CorruptCheckpointError(
                f"{path}: weight_map: tensor {name!r} maps to {str(f)[:100]!r}; expected a "
                f"file name beside the index"
            )
    return weight_map
