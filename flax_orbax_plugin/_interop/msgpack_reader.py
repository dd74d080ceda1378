"""Reading Flax msgpack checkpoints as data only: nothing in the file is imported or
called; every claimed length is checked before anything is allocated. Any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._interop.msgpack_reader``.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
from typing import Any

import jax
import msgpack
import numpy as np

from .._base import tree as _tree
from .._base.distributed import public
from .._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
)
from .._format import layout as _layout
from .._format.foreign import is_msgpack_checkpoint, is_orbax_checkpoint
from .._like import placing as _placing
from .._like.onto_like import check_policy
from .._storage.local_inputs import local_path
from .._storage.store_errors import arguments, refusals
from .._storage.untrusted import entry_kind, open_regular
from .orbax_reader import check_like_paths

__all__ = ["files_to_import", "read_msgpack", "restore_msgpack"]

_EXT_NDARRAY, _EXT_COMPLEX, _EXT_NPSCALAR = 1, 2, 3
_CHUNKED = "__msgpack_chunked_array__"
# Flax writes an ndarray as (shape, dtype name, bytes): any dtype of the package's table
_ALLOWED_DTYPES = {name: _layout.dtype_from_name(name) for name in sorted(_layout.DTYPES)}
_CHECKPOINT_RE = re.compile(r"^(?P<prefix>.*?)(?P<step>[0-9]+)$")
_MAX_DEPTH = 128  # nesting of the state dict; deeper is not a Flax checkpoint
_MAX_NDIM = 64  # numpy's own limit


def _sizes(shape: list) -> bool:
    """Every entry a size: a non-negative int (not a bool)."""
    return all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)


def _ndarray(data: bytes, where: str) -> np.ndarray:
    try:
        shape, dtype_name, buffer = msgpack.unpackb(data, raw=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise CorruptCheckpointError(f"{where}: malformed ndarray payload ({e})") from e
    name = dtype_name.decode("ascii", "replace") if isinstance(dtype_name, bytes) else dtype_name
    if not isinstance(name, str) or name not in _ALLOWED_DTYPES:
        raise CorruptCheckpointError(
            f"{where}: ndarray of dtype {str(name)[:100]!r}; expected one of "
            f"{sorted(_ALLOWED_DTYPES)}"
        )
    if not isinstance(shape, (list, tuple)) or len(shape) > _MAX_NDIM or not _sizes(shape):
        raise CorruptCheckpointError(
            f"{where}: ndarray shape {str(shape)[:200]} is not a list of at most {_MAX_NDIM} sizes"
        )
    dtype = _ALLOWED_DTYPES[name]
    count = math.prod(shape)  # Python ints: no overflow
    if not isinstance(buffer, bytes) or len(buffer) != count * dtype.itemsize:
        found = len(buffer) if isinstance(buffer, bytes) else type(buffer).__name__
        raise CorruptCheckpointError(
            f"{where}: ndarray {name}{list(shape)} needs {count * dtype.itemsize} bytes, "
            f"found {found}"
        )
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def _ext_hook(where: str):
    def hook(code: int, data: bytes) -> Any:
        if code == _EXT_NDARRAY:
            return _ndarray(data, where)
        if code == _EXT_NPSCALAR:
            return _ndarray(data, where)[()]
        if code == _EXT_COMPLEX:
            try:
                real, imag = msgpack.unpackb(data)
                return complex(float(real), float(imag))
            except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
                raise CorruptCheckpointError(f"{where}: malformed complex payload ({e})") from e
        raise CorruptCheckpointError(f"{where}: unknown msgpack extension type {code}")

    return hook


def _as_tuple(d: Any, where: str) -> list[Any]:
    if not isinstance(d, dict) or sorted(d, key=str) != sorted(map(str, range(len(d)))):
        keys = list(d)[:5] if isinstance(d, dict) else type(d).__name__
        raise CorruptCheckpointError(f"{where}: malformed chunked array (keys {keys})")
    return [d[str(i)] for i in range(len(d))]


def _key_path(keys: list[Any]) -> str:
    return "/".join(str(k) for k in keys) or "<root>"


def _unchunk(tree: Any, where: str, keys: list[Any] | None = None) -> Any:
    """The tree with chunked arrays joined, depth and key types checked."""
    keys = [] if keys is None else keys
    if len(keys) > _MAX_DEPTH:
        raise CorruptCheckpointError(
            f"{where}: nested deeper than {_MAX_DEPTH} levels at {_key_path(keys[:8])}/...; "
            f"expected a Flax state dict"
        )
    if isinstance(tree, list):
        return [_unchunk(v, where, [*keys, i]) for i, v in enumerate(tree)]
    if not isinstance(tree, dict):
        return tree
    kinds = {str if isinstance(k, str) else int if type(k) is int else None for k in tree}
    if None in kinds or len(kinds) > 1:
        found = sorted({type(k).__name__ for k in tree})
        raise CorruptCheckpointError(
            f"{where}: map at {_key_path(keys)!r}: expected keys that are all strings (or all "
            f"integers), found keys of type {', '.join(found)}"
        )
    if tree.get(_CHUNKED) is True:
        here = f"{where}: chunked array at {_key_path(keys)!r}"
        shape = _as_tuple(tree.get("shape"), here)
        chunks = _as_tuple(tree.get("chunks"), here)
        if not _sizes(shape):
            raise CorruptCheckpointError(f"{here}: shape {str(shape)[:200]} is not a list of sizes")
        if (
            not chunks
            or len(shape) > _MAX_NDIM
            or not all(isinstance(c, np.ndarray) and c.ndim == 1 for c in chunks)
            or len({c.dtype for c in chunks}) != 1
        ):
            raise CorruptCheckpointError(
                f"{here}: expected 1-D chunks of one dtype and at most {_MAX_NDIM} dimensions"
            )
        count = sum(c.size for c in chunks)
        if count != math.prod(shape):  # Python ints: no overflow
            raise CorruptCheckpointError(
                f"{here}: shape {shape} needs {math.prod(shape)} values, the chunks hold {count}"
            )
        return np.concatenate(chunks).reshape(shape)
    return {k: _unchunk(v, where, [*keys, k]) for k, v in tree.items()}


def read_msgpack(path: Any) -> Any:
    """The state dict in a Flax msgpack file: nested dicts of numpy arrays and scalars."""
    path = local_path(path, what="msgpack checkpoint")
    where = str(path)
    if os.path.isdir(path):
        raise CheckpointNotFoundError(
            f"{where}: a directory, not a msgpack file{_orbax_hint(path)}"
        )
    fd, st = open_regular(path, follow_links=True, what="msgpack checkpoint")
    with open(fd, "rb", closefd=True) as f:
        size = st.st_size
        if size == 0:
            raise CorruptCheckpointError(f"{where}: empty file, expected a msgpack state dict")
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as data:
            try:
                tree = msgpack.unpackb(  # every claimed length is bounded by the file size
                    data,
                    ext_hook=_ext_hook(where),
                    raw=False,
                    strict_map_key=False,
                    max_str_len=size,
                    max_bin_len=size,
                    max_ext_len=size,
                    max_array_len=size,
                    max_map_len=size // 2,
                )
            except CorruptCheckpointError:
                raise
            except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as e:
                raise CorruptCheckpointError(f"{where}: not a Flax msgpack checkpoint ({e})") from e
    return _unchunk(tree, where)


@public(errors=refusals(arguments("path")))
def restore_msgpack(
    path: Any, like: Any = None, *, partial: bool = False, cast: str = "safe"
) -> Any:
    """A msgpack checkpoint in the form of ``like`` (None: the state dict as read), by
    the rules of ``fop.restore``: ``partial`` allows keys ``like`` lacks, and a dtype
    change must be lossless unless ``cast="unsafe"``."""
    check_policy(cast)
    tree = read_msgpack(path)
    if like is None:
        return tree
    flat, _ = _tree.flatten(tree)
    stored = {p: v for p, _, v in flat}
    like_flat, treedef = _tree.flatten(like)
    check_like_paths(like_flat, stored, sorted(stored), str(path), partial=partial)
    out = []
    for p, _, leaf_like in like_flat:
        value = stored[p]
        if _tree.is_empty_node(leaf_like) and (value is None or _tree.is_empty_node(value)):
            out.append(leaf_like)  # no data either way: like's own node (optax's EmptyState)
            continue
        if value is None or isinstance(value, str):
            out.append(value)
            continue
        host = np.asarray(value)
        plan = _placing.plan(
            p, host.shape, host.dtype, leaf_like, source=str(path), allow_cast=cast == "unsafe"
        )
        out.append(_placing.materialize(plan, lambda index, host=host: host[index]))
    return jax.tree_util.tree_unflatten(treedef, out)


def files_to_import(src: Any, step: int | None) -> list[tuple[int | None, str]]:
    """``[(the step its name gives or None, file)]`` of one msgpack file, or of every
    ``<prefix><step>`` file of a directory (or only ``step``)."""
    src = local_path(src, what="msgpack source")
    try:
        mode = os.stat(src).st_mode  # the path the user named: a link to it is their choice
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{src}: no such file or directory") from None
    if stat.S_ISREG(mode):  # a name ending in digits gives its number
        m = _CHECKPOINT_RE.match(os.path.basename(src))
        return [(int(m.group("step")) if m else None, src)]
    if not stat.S_ISDIR(mode):
        raise ForeignEntryError(
            f"{src}: expected a msgpack checkpoint file or a directory of them, found "
            f"{entry_kind(mode)} (not read)"
        )
    found = []
    for name in sorted(os.listdir(src)):
        m = _CHECKPOINT_RE.match(name)
        full = os.path.join(src, name)
        if m and not os.path.islink(full) and os.path.isfile(full) and is_msgpack_checkpoint(full):
            found.append((int(m.group("step")), full))
    if not found:
        raise CheckpointNotFoundError(
            f"{src}: no flax.training.checkpoints files (checkpoint_<step>) in it{_orbax_hint(src)}"
        )
    found.sort()
    if step is not None:
        found = [(s, f) for s, f in found if s == step]
        if not found:
            raise CheckpointNotFoundError(f"{src}: no msgpack checkpoint for step {step}")
    return found


def _orbax_hint(path: str) -> str:
    """Where directory ``path`` holds Orbax checkpoints: the readers that take them."""
    orbax = is_orbax_checkpoint(path) or any(
        _CHECKPOINT_RE.match(n) and is_orbax_checkpoint(os.path.join(path, n))
        for n in sorted(os.listdir(path))[:16]
    )
    if not orbax:
        return ""
    return (
        ": it holds Orbax checkpoints (flax.training.checkpoints writes them so since Flax "
        "0.7): read them with fop.restore / fop.restore_params, or fop.import_orbax(src, dst)"
    )
