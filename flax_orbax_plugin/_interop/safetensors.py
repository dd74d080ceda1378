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

Trust rules. Reading: every file (a ``.safetensors`` file, a shard an index
lists, the index itself) is opened with ``O_NONBLOCK`` and must be a regular file:
a FIFO, device, socket or directory is a :class:`ForeignEntryError` naming it,
never a hang. A symlink *is* followed when reading, because the files users name
are symlinks in the Hugging Face cache (``snapshots/<rev>/model.safetensors ->
../../blobs/<hash>``); it must resolve to a regular file, and each file is checked
to be the same one (device, inode, size) when its data is read as when its header
was. The header length, every shape (in Python ints) and every ``data_offsets``
pair are checked against the real file size (and the header against a 100 MiB
cap) before anything sized by them is allocated; the index is capped at 64 MiB.

Writing: nothing is ever written through a link. Each file is written under a new,
unpredictable name (``.<name>.tmp-<random hex>``, created with ``O_CREAT | O_EXCL |
O_NOFOLLOW``, mode 0o644) and renamed over the final name, which replaces a name
and never follows it. Every file written carries ``{"flax_orbax_plugin": "1"}`` in
its metadata (the header's ``__metadata__``, the index's ``metadata``). ``force``
replaces or removes only files proven ours: a regular file (not a link) carrying
that marker, and for stale files an old index lists, also named like our shards
(``<stem>.safetensors``, ``<stem>-NNNNN-of-NNNNN.safetensors``); anything else an
old index names (``config.json``) is left alone with a warning, and an existing
output name held by anything not ours is a :class:`ForeignEntryError`, even with
``force``, before anything is written.

Who calls what: the CLI's ``export`` calls :func:`export_checkpoint`; users call
:func:`to_safetensors` / :func:`from_safetensors`. Export is a single-process
operation (run it on one host); import is collective-free and works on every
process of a multi-process job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

from .._base import tree as _tree
from .._core import restore as _restore
from .._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
    StructureError,
)
from .._like import onto_like as _onto_like
from .._storage.location import Location
from .._storage.untrusted import loads_json, open_regular, read_capped

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
_MAX_INDEX_BYTES = 64 << 20  # an index.json read into memory
# In every header's __metadata__ and every index's metadata this library writes: only
# a regular file carrying it (and named like our shards) is ever replaced or removed.
MARKER_KEY = "flax_orbax_plugin"
MARKER_VALUE = "1"
_SHARD_NAME_RE = r"{stem}(?:(?:-[0-9]{{5}}-of-[0-9]{{5}})?\.safetensors|\.safetensors\.index\.json)"
_log = logging.getLogger(__name__)
_MAX_NDIM = 64
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
        return math.prod(self.shape) * self.dtype.itemsize


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
    meta[MARKER_KEY] = MARKER_VALUE  # proves, to a later --force, that we wrote the file
    total = sum(t.nbytes for t in tensors)
    os.makedirs(directory, exist_ok=True)
    tmps: list[str] = []  # every temporary file this call created (and only those)
    shard_of = {t.path: i for i, shard in enumerate(shards) for t in shard}
    by_path = {t.path: t for t in tensors}
    files: list[Any] = [None] * len(shards)
    shard_tmps: list[str | None] = [None] * len(shards)

    def start(i: int) -> Any:
        tmp, f = _create_temp(directory, names[i])
        tmps.append(tmp)
        shard_tmps[i] = tmp
        f.write(_header(shards[i], meta))
        return f

    try:
        with _progress(progress, total) as bar:
            current = -1
            for group in _groups(tensors):
                for path, value in read([t.path for t in group]):
                    i = shard_of[path]
                    if i != current:
                        _close(files, current)
                        files[i] = start(i)
                        current = i
                    t = by_path[path]
                    data = _tensor_bytes(t, value)
                    files[i].write(memoryview(data))
                    bar.advance(data.nbytes, path)
                    del data, value  # one leaf (or one group) in memory at a time
            _close(files, current)
            for i in range(len(shards)):
                if files[i] is None:  # a shard of empty tensors only
                    files[i] = start(i)
                    _close(files, i)
        old = _old_outputs(directory, index_name) if force else set()
        for tmp, final in zip(shard_tmps, finals, strict=True):
            os.replace(tmp, final)  # replaces a name, never writes through a link
        if index_path is not None:
            index = {
                "metadata": {"total_size": total, MARKER_KEY: MARKER_VALUE},
                "weight_map": {t.name: names[shard_of[t.path]] for t in tensors},
            }
            tmp, f = _create_temp(directory, index_name)
            tmps.append(tmp)
            with f:
                f.write(json.dumps(index, indent=2, sort_keys=True).encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, index_path)
        stem = index_name[: -len(INDEX_SUFFIX)]
        for stale in sorted(old - set(names) - ({index_name} if index_path else set())):
            _remove_if_ours(directory, stale, stem)  # only files an old index listed
        single = os.path.join(directory, index_name.replace(INDEX_SUFFIX, ".safetensors"))
        if force and index_path is not None and os.path.lexists(single):
            _remove_if_ours(directory, os.path.basename(single), stem)  # an unsharded export
        _fsync_dir(directory)
    except BaseException:
        for f in files:
            if f is not None and not f.closed:
                f.close()
        for tmp in tmps:  # ours: created exclusively under an unpredictable name
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
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
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a scalar 1-D)
        arr = arr.copy(order="C")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if tuple(arr.shape) != t.shape:
        raise StructureError(
            f"leaf {t.path!r}: expected shape {t.shape} for tensor {t.name!r}, found {arr.shape}"
        )
    return arr.reshape(-1).view(np.uint8)


def _create_temp(directory: str, final_name: str) -> tuple[str, Any]:
    """A new file beside ``final_name`` under an unpredictable name, created exclusively
    (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0o644): a planted file or symlink is never
    opened, followed or truncated. Returns (path, binary file object)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        path = os.path.join(directory, f".{final_name}.tmp-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            continue  # vanishingly unlikely: draw another name
        return path, os.fdopen(fd, "wb")
    raise FileExistsError(f"{directory}: could not create a temporary file for {final_name}")


def _proven_ours(path: str) -> tuple[bool, str]:
    """(True, "") when ``path`` is a regular file (not a link) this library wrote: a
    safetensors file whose header metadata, or an index whose metadata, carries our
    marker; else (False, what was found). Opens without following or blocking."""
    try:
        fd, st = open_regular(path, follow_links=False, what="file")
    except CheckpointNotFoundError:
        return False, "nothing"
    except (ForeignEntryError, OSError) as e:
        return False, str(e)
    try:
        if path.endswith(INDEX_SUFFIX):
            if st.st_size > _MAX_INDEX_BYTES:
                return False, f"an index of {st.st_size} bytes"
            doc = loads_json(_pread_exact(fd, st.st_size, 0, path, "index"), path)
            meta = doc.get("metadata") if isinstance(doc, dict) else None
        else:
            _, header = _header_json(fd, st.st_size, path)
            meta = header.get("__metadata__")
    except (CorruptCheckpointError, OSError) as e:
        return False, f"a file that is not one of our exports ({e})"
    finally:
        os.close(fd)
    if isinstance(meta, dict) and meta.get(MARKER_KEY) == MARKER_VALUE:
        return True, ""
    return False, f"a file without the {MARKER_KEY!r} marker this library writes"


def _remove_if_ours(directory: str, name: str, stem: str) -> None:
    """Removes ``directory/name`` only when it is named like our shards of ``stem`` and
    proven ours (:func:`_proven_ours`); anything else is left alone with a warning."""
    path = os.path.join(directory, name)
    if not re.fullmatch(_SHARD_NAME_RE.format(stem=re.escape(stem)), name):
        _log.warning("%s: listed by the old index but not named like our shards; left alone", path)
        return
    ours, found = _proven_ours(path)
    if not ours:
        if found != "nothing":
            _log.warning("%s: listed by the old index, but %s; left alone", path, found)
        return
    os.unlink(path)  # the name itself: a link put there since would be unlinked, not followed


def _old_outputs(directory: str, index_name: str) -> set[str]:
    """Files listed by an index of ours already in ``directory``, plus the index itself
    (empty when there is none, or it is not proven ours)."""
    path = os.path.join(directory, index_name)
    if not _proven_ours(path)[0]:
        return set()
    try:
        raw = read_capped(path, follow_links=False, what="index", max_bytes=_MAX_INDEX_BYTES)
        weight_map = loads_json(raw, path).get("weight_map", {})
        listed = {v for v in weight_map.values() if isinstance(v, str) and _plain_name(v)}
    except (OSError, CorruptCheckpointError, AttributeError):
        return set()
    return listed | {index_name}


def _check_outputs(directory: str, names: list[str], index_name: str, force: bool) -> None:
    """Without ``force`` any existing output name is a FileExistsError; with it, each
    existing one must be proven ours (a regular file carrying our marker), else a
    ForeignEntryError: what this library did not write is never replaced."""
    single = names[0] if len(names) == 1 else index_name.replace(INDEX_SUFFIX, ".safetensors")
    targets = sorted({*names, index_name, single})
    clash = [n for n in targets if os.path.lexists(os.path.join(directory, n))]
    if not clash:
        return
    if not force:
        raise FileExistsError(
            f"{os.path.join(directory, clash[0])} exists; pass force=True (--force) "
            f"to replace the export"
        )
    for name in clash:
        ours, found = _proven_ours(os.path.join(directory, name))
        if not ours and found != "nothing":
            raise ForeignEntryError(
                f"{os.path.join(directory, name)}: expected an earlier export of this library "
                f"to replace, found {found}; it is left alone (nothing was written). Remove it "
                f"yourself or export elsewhere"
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
    raw = read_capped(
        os.fspath(path), follow_links=True, what="key map file", max_bytes=_MAX_INDEX_BYTES
    )
    try:
        mapping = loads_json(raw, os.fspath(path))
    except CorruptCheckpointError as e:
        raise ValueError(str(e)) from None
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
    identity: tuple[int, int, int] = (0, 0, 0)  # (st_dev, st_ino, size) when the header was read


def _plain_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and not os.path.isabs(name)
    )


def _pread_exact(fd: int, n: int, offset: int, path: str, what: str) -> bytes:
    parts, done = [], 0
    while done < n:
        chunk = os.pread(fd, n - done, offset + done)
        if not chunk:
            raise CorruptCheckpointError(f"{path}: file ended {n - done} bytes early in its {what}")
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def _header_json(fd: int, size: int, path: str) -> tuple[int, Any]:
    """(header length, parsed header) of an open safetensors file of ``size`` bytes; the
    claimed length is checked against the file and the cap before it is read."""
    if size < 8:
        raise CorruptCheckpointError(f"{path}: {size} bytes, too short for a safetensors file")
    n = int.from_bytes(_pread_exact(fd, 8, 0, path, "header length"), "little")
    if n > min(_MAX_HEADER_BYTES, size - 8):
        raise CorruptCheckpointError(
            f"{path}: header length {n} exceeds the file ({size} bytes) or the "
            f"{_MAX_HEADER_BYTES}-byte limit"
        )
    header = loads_json(_pread_exact(fd, n, 8, path, "header"), f"{path}: header")
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object")
    return n, header


def _read_header(path: str) -> dict[str, _Stored]:
    # A symlink is followed here (Hugging Face cache snapshots link each file to its
    # blob); it must resolve to a regular file, and a FIFO never blocks.
    fd, st = open_regular(path, follow_links=True, what="safetensors file")
    try:
        size = st.st_size
        n, header = _header_json(fd, size, path)
    finally:
        os.close(fd)
    identity = (st.st_dev, st.st_ino, size)
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
        if not isinstance(tag, str) or tag not in _DTYPES:
            raise CorruptCheckpointError(
                f"{where}: dtype {str(tag)[:100]!r} not supported (expected one of "
                f"{sorted(_DTYPES)})"
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
        dtype = _DTYPES[tag]
        need = math.prod(shape) * dtype.itemsize  # Python ints: never overflows
        if offsets[1] - offsets[0] != need:
            raise CorruptCheckpointError(
                f"{where}: {tag}{shape} needs {need} bytes, data_offsets span "
                f"{offsets[1] - offsets[0]}"
            )
        spans.append((offsets[0], offsets[1], name))
        out[name] = _Stored(name, path, dtype, tuple(shape), 8 + n + offsets[0], identity)
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
    # Like the shards, the index the user names may be a symlink to a regular file.
    raw = read_capped(
        path, follow_links=True, what="safetensors index file", max_bytes=_MAX_INDEX_BYTES
    )
    doc = loads_json(raw, path)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{path}: expected an object with a 'weight_map'")
    for name, f in weight_map.items():
        if not isinstance(f, str) or not _plain_name(f):
            raise CorruptCheckpointError(
                f"{path}: weight_map: tensor {name!r} maps to {str(f)[:100]!r}; expected a "
                f"file name beside the index"
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
