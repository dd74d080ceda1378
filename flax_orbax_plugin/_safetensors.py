"""Hugging Face safetensors, both ways: sharded export and sharded, resharding import.

A safetensors file is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8, then the tensors' raw little-endian C-order
bytes (offsets count from the end of the header). Above a size limit, Hugging Face
splits a model into ``model-00001-of-00003.safetensors`` ... and writes
``model.safetensors.index.json``: ``{"metadata": {"total_size": bytes},
"weight_map": {name: file}}``.

Export (:func:`to_safetensors`) reads a checkpoint a group of leaves at a time
(never the whole tree), maps each leaf path to a tensor name (``key_map``; by
default the path with '/' replaced by '.'), optionally transposes Flax kernels to
PyTorch's layout, and writes each file under a temporary name, renaming it into
place once durable; the index is written last.

Import (:func:`from_safetensors`) validates every header before reading, then
reads each leaf of ``like`` straight onto its sharding: each process reads only
the regions its devices hold (one ``pread`` per contiguous run of bytes, straight
into the destination buffer). Shapes must match;
dtype changes must not change a value (see :mod:`_onto_like`).

Who calls what: the CLI's ``export`` calls :func:`export_checkpoint`; users call
:func:`to_safetensors` / :func:`from_safetensors`. Export is a single-process
operation (run it on one host); import is collective-free and works on every
process of a multi-process job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from . import _onto_like, _tree
from ._errors import CheckpointNotFoundError, CorruptCheckpointError, StructureError
from ._storage import Location

__all__ = [
    "ExportResult",
    "from_safetensors",
    "parse_size",
    "read_safetensors_index",
    "to_safetensors",
]

DEFAULT_MAX_SHARD_SIZE = "5GB"
INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_STEM = "model"
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
_GROUP_BYTES = 64 << 20  # leaves read per partial restore when exporting a checkpoint

# safetensors dtype tag <-> numpy dtype
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_TAGS = {dtype: tag for tag, dtype in _DTYPES.items()}

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]?I?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes in a size such as ``5GB`` (10**9 bytes a GB, as Hugging Face counts),
    ``2MiB`` (2**20), ``500KB`` or a plain number of bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and (m := _SIZE_RE.match(size)):
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        raise ValueError(
            f"max shard size: expected bytes or a size such as '5GB', '500MB', '2GiB', "
            f"found {size!r}"
        )
    if value <= 0:
        raise ValueError(f"max shard size: expected a positive size, found {size!r}")
    return value


def default_name(path: str) -> str:
    """The default tensor name of a leaf path: ``params/Dense_0/kernel`` -> ``Dense_0.kernel``
    (relative to the exported checkpoint, so ``'/'`` becomes ``'.'``)."""
    return path.replace("/", ".")


def _kernel_axes(path: str, ndim: int, transpose: bool) -> tuple[int, ...] | None:
    """The permutation from Flax's kernel layout (..., in, out) to PyTorch's (out, in, ...)."""
    if not transpose or ndim < 2 or path.rsplit("/", 1)[-1] != "kernel":
        return None
    return (ndim - 1, ndim - 2, *range(ndim - 2))


# -- export -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What :func:`to_safetensors` wrote."""

    files: tuple[str, ...]  # the safetensors files, in order
    index: str | None  # model.safetensors.index.json, when sharded
    tensors: int
    total_bytes: int  # tensor bytes, as the index's total_size


@dataclasses.dataclass(frozen=True)
class _Tensor:
    path: str  # leaf path in the source
    name: str  # tensor name in the files
    dtype: np.dtype  # written dtype
    shape: tuple[int, ...]  # written shape (after any transpose)
    axes: tuple[int, ...] | None  # transpose applied on write

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _header(tensors: Sequence[_Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": _TAGS[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def _shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Greedy, in order, as Hugging Face does: a tensor larger than the limit gets a
    file of its own."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _output_names(out: str, count: int) -> tuple[str, list[str], str]:
    """(directory, file names, index name) for ``out``: a ``*.safetensors`` file path
    (its stem names the shards) or a directory (``model*.safetensors`` inside)."""
    if out.endswith(".safetensors"):
        directory, stem = os.path.dirname(os.path.abspath(out)), os.path.basename(out)[:-12]
    else:
        directory, stem = os.path.abspath(out), DEFAULT_STEM
    if count == 1:
        return directory, [f"{stem}.safetensors"], f"{stem}{INDEX_SUFFIX}"
    names = [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    return directory, names, f"{stem}{INDEX_SUFFIX}"


def _plan(
    leaves: list[tuple[str, np.dtype, tuple[int, ...]]],
    key_map: Callable[[str], str | None] | None,
    transpose_kernels: bool,
    dtype: Any,
) -> list[_Tensor]:
    names = {}
    for path, _, _ in leaves:
        name = (key_map or default_name)(path)
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"key_map: leaf {path!r}: expected a tensor name, found {name!r}")
            names[path] = name
    if key_map is None and len(set(names.values())) != len(names):
        names = {p: p for p in names}  # 'a.b' and 'a/b' collide: keep the full paths
    seen: dict[str, str] = {}
    tensors = []
    for path, leaf_dtype, shape in leaves:
        if path not in names:
            continue
        name = names[path]
        if name in seen:
            raise ValueError(f"key_map: leaves {seen[name]!r} and {path!r} both map to {name!r}")
        seen[name] = path
        out_dtype = np.dtype(leaf_dtype)
        if dtype is not None and _onto_like._is_float(out_dtype):
            out_dtype = np.dtype(dtype)
        if out_dtype not in _TAGS:
            raise StructureError(
                f"leaf {path!r}: dtype {out_dtype} has no safetensors equivalent "
                f"(expected one of {sorted(str(d) for d in _TAGS)})"
            )
        axes = _kernel_axes(path, len(shape), transpose_kernels)
        out_shape = tuple(shape[a] for a in axes) if axes else tuple(shape)
        tensors.append(_Tensor(path, name, out_dtype, out_shape, axes))
    return tensors


def _unescape(part: str) -> str:
    return part.replace("%2F", "/").replace("%25", "%")


def _checkpoint_leaves(src: Any) -> tuple[list, Callable[[list[str]], Iterator]]:
    """Leaves of one of this plugin's checkpoints and a reader of a group of them."""
    from . import _restore

    meta = _restore.metadata(src)
    keys = [leaf.path for leaf in meta.leaves.values() if leaf.kind == "prng_key"]
    if keys:
        raise StructureError(
            f"leaf {keys[0]!r}: a PRNG key array has no safetensors equivalent (expected "
            f"numeric arrays, found a typed key); keep keys out of the exported item, "
            f"or save jax.random.key_data(key) there instead"
        )
    leaves = [
        (leaf.path, _dtype_of(leaf.dtype), tuple(leaf.shape))
        for leaf in meta.leaves.values()
        if leaf.dtype is not None
    ]

    def read(paths: list[str]) -> Iterator[tuple[str, np.ndarray]]:
        template: dict[str, Any] = {}
        for path in paths:
            node = template
            parts = [_unescape(p) for p in path.split("/")]
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = None
        flat, _ = _tree.flatten(_restore.restore(src, template, partial=True))
        values = {p: v for p, _, v in flat}
        for path in paths:
            yield path, np.asarray(values.pop(path))

    return leaves, read


def _dtype_of(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _tree_leaves(tree: Any) -> tuple[list, Callable[[list[str]], Iterator]]:
    flat, _ = _tree.flatten(tree)
    values = {p: v for p, _, v in flat if v is not None}
    leaves = [(p, np.dtype(np.asarray(v).dtype), tuple(np.shape(v))) for p, v in values.items()]

    def read(paths):
        for path in paths:
            yield path, np.asarray(values[path])

    return leaves, read


def _groups(tensors: list[_Tensor]) -> list[list[_Tensor]]:
    """Leaves read per partial restore: the same greedy split as the shards."""
    return [g for g in _shards(tensors, _GROUP_BYTES) if g]


def to_safetensors(
    source: Any,
    out: Any,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    key_map: Callable[[str], str | None] | None = None,
    transpose_kernels: bool = False,
    dtype: Any = None,
    metadata: dict[str, str] | None = None,
    force: bool = False,
    progress: Callable[[int], Any] | None = None,
) -> ExportResult:
    """Writes ``source`` as safetensors, sharded above ``max_shard_size``.

    Args:
      source: a checkpoint of this plugin holding one pytree (e.g. ``DIR/<step>/params``),
        read a group of leaves at a time; or an in-memory pytree of arrays.
      out: ``path/name.safetensors`` (shards are ``name-00001-of-0000N.safetensors``
        with ``name.safetensors.index.json``) or a directory (``model.safetensors``...).
      max_shard_size: bytes or a size such as ``"5GB"`` (10**9) or ``"2GiB"`` (2**30).
      key_map: leaf path (``Dense_0/kernel``) -> tensor name, or None to leave the leaf
        out. Default: '/' replaced by '.'.
      transpose_kernels: write leaves named ``kernel`` in PyTorch's layout: a Dense
        kernel ``(in, out)`` as ``(out, in)``, a conv kernel ``(*spatial, in, out)``
        as ``(out, in, *spatial)``.
      dtype: cast floating leaves (e.g. ``"bfloat16"``); an explicit, lossy opt-in.
      metadata: the header's ``__metadata__`` (strings); default ``{"format": "flax"}``,
        ``{"format": "pt"}`` with ``transpose_kernels``.
      force: replace existing output files (and the shards an old index listed);
        without it an existing output is a FileExistsError.
      progress: ``progress(total_bytes)`` returns a context manager with
        ``advance(nbytes, note)`` (the CLI's progress bar).
    """
    limit = parse_size(max_shard_size)
    if isinstance(source, (str, os.PathLike, Location)) or (
        isinstance(source, dict) and "driver" in source
    ):
        leaves, read = _checkpoint_leaves(source)
    else:
        leaves, read = _tree_leaves(source)
    tensors = _plan(leaves, key_map, transpose_kernels, dtype)
    shards = _shards(tensors, limit)
    directory, names, index_name = _output_names(os.fspath(out), len(shards))
    finals = [os.path.join(directory, n) for n in names]
    index_path = os.path.join(directory, index_name) if len(shards) > 1 else None
    _check_outputs(directory, names, index_name, force)
    if metadata is None:
        metadata = {"format": "pt" if transpose_kernels else "flax"}
    meta = {str(k): str(v) for k, v in metadata.items()}
    total = sum(t.nbytes for t in tensors)
    os.makedirs(directory, exist_ok=True)
    tmps = [f"{f}.tmp-{os.getpid()}" for f in finals]
    shard_of = {t.path: i for i, shard in enumerate(shards) for t in shard}
    by_path = {t.path: t for t in tensors}
    files: list[Any] = [None] * len(shards)
    try:
        with _progress(progress, total) as bar:
            current = -1
            for group in _groups(tensors):
                for path, value in read([t.path for t in group]):
                    i = shard_of[path]
                    if i != current:
                        _close(files, current)
                        files[i] = open(tmps[i], "wb")
                        files[i].write(_header(shards[i], meta))
                        current = i
                    t = by_path[path]
                    data = _tensor_bytes(t, value)
                    files[i].write(memoryview(data))
                    bar.advance(data.nbytes, path)
            _close(files, current)
            for i, shard in enumerate(shards):
                if files[i] is None:  # a shard of empty tensors only
                    with open(tmps[i], "wb") as f:
                        f.write(_header(shard, meta))
        for tmp, final in zip(tmps, finals, strict=True):
            os.replace(tmp, final)
        old = _old_outputs(directory, index_name) if force else set()
        if index_path is not None:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {t.name: names[shard_of[t.path]] for t in tensors},
            }
            tmp = f"{index_path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, index_path)
        for stale in old - set(names) - ({index_name} if index_path else set()):
            os.remove(os.path.join(directory, stale))  # only files an old index listed
        single = os.path.join(directory, index_name.replace(INDEX_SUFFIX, ".safetensors"))
        if force and index_path is not None and os.path.isfile(single):
            os.remove(single)  # an earlier unsharded export to the same name
        _fsync_dir(directory)
    except BaseException:
        for f in files:
            if f is not None and not f.closed:
                f.close()
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    return ExportResult(tuple(finals), index_path, len(tensors), total)


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, amount: int = 1, note: str = "") -> None:
        pass


def _progress(factory, total):
    return factory(total) if factory is not None else _NoProgress()


def _close(files: list, i: int) -> None:
    if i >= 0 and files[i] is not None and not files[i].closed:
        files[i].flush()
        os.fsync(files[i].fileno())
        files[i].close()


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tensor_bytes(t: _Tensor, value: Any) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype != t.dtype:
        arr = arr.astype(t.dtype)
    if t.axes is not None:
        arr = arr.transpose(t.axes)
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if tuple(arr.shape) != t.shape:
        raise StructureError(
            f"leaf {t.path!r}: expected shape {t.shape} for tensor {t.name!r}, found {arr.shape}"
        )
    return arr.reshape(-1).view(np.uint8)


def _old_outputs(directory: str, index_name: str) -> set[str]:
    """Files listed by an index already in ``directory``, plus the index itself."""
    path = os.path.join(directory, index_name)
    if not os.path.isfile(path):
        return set()
    try:
        with open(path) as f:
            weight_map = json.load(f).get("weight_map", {})
        listed = {v for v in weight_map.values() if isinstance(v, str) and _plain_name(v)}
    except (OSError, ValueError, AttributeError):
        return set()
    return listed | {index_name}


def _check_outputs(directory: str, names: list[str], index_name: str, force: bool) -> None:
    if force:
        return
    single = names[0] if len(names) == 1 else index_name.replace(INDEX_SUFFIX, ".safetensors")
    clash = [n for n in {*names, index_name, single} if os.path.lexists(os.path.join(directory, n))]
    if clash:
        raise FileExistsError(
            f"{os.path.join(directory, sorted(clash)[0])} exists; pass force=True (--force) "
            f"to replace the export"
        )


def export_checkpoint(src: Any, out: Any, **options: Any) -> ExportResult:
    """``flax-orbax export``: :func:`to_safetensors` of one of this plugin's checkpoints."""
    src = Location.from_path(src)
    fmt = "pt" if options.get("transpose_kernels") else "flax"
    options.setdefault("metadata", {"format": fmt, "source": str(src), "exported_by": "flax-orbax"})
    return to_safetensors(src, out, **options)


def key_map_from_file(path: str) -> Callable[[str], str | None]:
    """A key_map from a JSON object ``{leaf path: tensor name or null}``; leaves not
    listed keep their default name."""
    with open(path) as f:
        try:
            mapping = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(mapping, dict) or not all(
        isinstance(v, str) or v is None for v in mapping.values()
    ):
        raise ValueError(f"{path}: expected a JSON object of leaf path -> tensor name or null")
    return lambda leaf: mapping.get(leaf, default_name(leaf))


# -- import -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stored:
    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute offset of the first byte in the file


def _plain_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and not os.path.isabs(name)
    )


def _read_header(path: str) -> dict[str, _Stored]:
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such safetensors file") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCheckpointError(f"{path}: {size} bytes, too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise CorruptCheckpointError(
                f"{path}: header length {n} exceeds the file ({size} bytes) or the "
                f"{_MAX_HEADER_BYTES}-byte limit"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object")
    data_len = size - 8 - n
    out: dict[str, _Stored] = {}
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{where}: expected an object, found {entry!r}")
        tag, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if tag not in _DTYPES:
            raise CorruptCheckpointError(
                f"{where}: dtype {tag!r} not supported (expected one of {sorted(_DTYPES)})"
            )
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise CorruptCheckpointError(f"{where}: shape {shape!r} is not a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CorruptCheckpointError(
                f"{where}: data_offsets {offsets!r} outside the {data_len} data bytes"
            )
        dtype = _DTYPES[tag]
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offsets[1] - offsets[0] != need:
            raise CorruptCheckpointError(
                f"{where}: {tag}{shape} needs {need} bytes, data_offsets span "
                f"{offsets[1] - offsets[0]}"
            )
        spans.append((offsets[0], offsets[1], name))
        out[name] = _Stored(name, path, dtype, tuple(shape), 8 + n + offsets[0])
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise CorruptCheckpointError(f"{path}: tensors {a!r} and {b!r} overlap")
    return out


def read_safetensors_index(paths_or_index: Any) -> dict[str, _Stored]:
    """Every tensor of one file, several files, an index or a directory; validated.

    A directory means its ``model.safetensors.index.json``, else its
    ``model.safetensors``. Files an index names must lie beside it (plain names).
    """
    if isinstance(paths_or_index, (list, tuple)):
        files = [os.fspath(p) for p in paths_or_index]
        index = None
    else:
        path = os.fspath(paths_or_index)
        if os.path.isdir(path):
            candidate = os.path.join(path, DEFAULT_STEM + INDEX_SUFFIX)
            single = os.path.join(path, DEFAULT_STEM + ".safetensors")
            if os.path.isfile(candidate):
                path = candidate
            elif os.path.isfile(single):
                path = single
            else:
                raise CheckpointNotFoundError(
                    f"{path}: no {DEFAULT_STEM}{INDEX_SUFFIX} or {DEFAULT_STEM}.safetensors in it"
                )
        if path.endswith(".json"):
            index = _read_index(path)
            directory = os.path.dirname(os.path.abspath(path))
            files = sorted({os.path.join(directory, f) for f in index.values()})
        else:
            files, index = [path], None
    stored: dict[str, _Stored] = {}
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
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such index file") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({e})") from e
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{path}: expected an object with a 'weight_map'")
    for name, f in weight_map.items():
        if not isinstance(f, str) or not _plain_name(f):
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} maps to {f!r}; expected a file name beside the index"
            )
    return weight_map


def _pread_into(fd: int, buf: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{where}: file ended {len(buf) - done} bytes early")
        done += n


def _read_region(fd: int, t: _Stored, index: tuple[slice, ...]) -> np.ndarray:
    """The region ``index`` (unit-step slices) of a stored tensor, read with one
    ``pread`` per contiguous run of bytes: nothing outside the region is read."""
    shape = t.shape
    starts = [s.indices(d)[0] for s, d in zip(index, shape, strict=True)]
    stops = [s.indices(d)[1] for s, d in zip(index, shape, strict=True)]
    out = np.empty([max(0, b - a) for a, b in zip(starts, stops, strict=True)], t.dtype)
    if out.size == 0:
        return out
    buf = memoryview(out.reshape(-1).view(np.uint8))
    where = f"{t.file} ({t.name})"
    if not shape:
        _pread_into(fd, buf, t.offset, where)
        return out
    itemsize = t.dtype.itemsize
    strides = [int(np.prod(shape[i + 1 :], dtype=np.int64)) * itemsize for i in range(len(shape))]
    k = len(shape) - 1  # axes after k are whole: a run spans axis k's slice
    while k > 0 and starts[k] == 0 and stops[k] == shape[k]:
        k -= 1
    run = (stops[k] - starts[k]) * strides[k]
    pos = 0
    for outer in np.ndindex(*[stops[i] - starts[i] for i in range(k)]):
        offset = t.offset + starts[k] * strides[k]
        offset += sum((starts[i] + o) * strides[i] for i, o in enumerate(outer))
        _pread_into(fd, buf[pos : pos + run], offset, where)
        pos += run
    return out


class _Files:
    """Open file descriptors of the tensors' files, closed together."""

    def __init__(self):
        self.fds: dict[str, int] = {}

    def reader(self, t: _Stored, axes: tuple[int, ...] | None) -> Callable:
        """read(index) in the leaf's layout (transposed back from PyTorch's if ``axes``)."""
        if t.file not in self.fds:
            self.fds[t.file] = os.open(t.file, os.O_RDONLY)
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
    allow_cast: bool = False,
) -> Any:
    """Reads safetensors straight onto the shardings of ``like``.

    Args:
      paths_or_index: a ``.safetensors`` file, a list of them, a
        ``*.safetensors.index.json`` or a directory holding ``model.safetensors``
        or ``model.safetensors.index.json``.
      like: a pytree of arrays / ``jax.ShapeDtypeStruct`` (with shardings: each
        process reads only the regions its devices hold), numpy arrays or scalars;
        None gives ``{tensor name: numpy array}``.
      key_map: leaf path -> tensor name, the same function as for export (default:
        '/' replaced by '.').
      transpose_kernels: the files hold kernels in PyTorch's layout (see export).
      partial: allow tensors in the files that ``like`` does not use.
      allow_cast: cast even when a value would change (otherwise StructureError).

    Raises:
      StructureError: a leaf of ``like`` has no tensor, a shape differs, a cast would
        change a value, or (without ``partial``) a tensor is left unused.
      CorruptCheckpointError: a header or index is malformed (names the file).
    """
    stored = read_safetensors_index(paths_or_index)
    files = _Files()
    try:
        return _read_onto(
            stored, paths_or_index, like, files, key_map, transpose_kernels, partial, allow_cast
        )
    finally:
        files.close()


def _read_onto(
    stored, paths_or_index, like, files, key_map, transpose_kernels, partial, allow_cast
):
    if like is None:
        return {
            name: files.reader(t, None)(tuple(slice(None) for _ in t.shape))
            for name, t in stored.items()
        }
    flat, treedef = _tree.flatten(like)
    used: set[str] = set()
    plans = []
    for path, _, leaf_like in flat:
        name = (key_map or default_name)(path)
        t = stored.get(name) if name is not None else None
        if t is None:
            raise StructureError(
                f"leaf {path!r}: expected tensor {name!r}, found no such tensor in {paths_or_index}"
            )
        used.add(name)
        axes = _kernel_axes(path, len(t.shape), transpose_kernels)
        shape = tuple(t.shape[i] for i in np.argsort(axes)) if axes else t.shape
        plan = _onto_like.plan(
            path, shape, t.dtype, leaf_like, source=f"{t.file} ({name})", allow_cast=allow_cast
        )
        plans.append((plan, t, axes))
    unused = sorted(set(stored) - used)
    if unused and not partial:
        raise StructureError(
            f"tensor {unused[0]!r}: found in {paths_or_index} but no leaf of like maps to it"
            + (f" ({len(unused) - 1} more)" if len(unused) > 1 else "")
            + "; pass partial=True to read a subset"
        )
    values = [_onto_like.materialize(plan, files.reader(t, axes)) for plan, t, axes in plans]
    return jax.tree_util.tree_unflatten(treedef, values)
