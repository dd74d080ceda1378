"""Export: :func:`to_safetensors` (and the CLI's :func:`export_checkpoint`): read a group
of leaves at a time into shards renamed into place once durable, the index last. Single
process, one thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ..._base import interrupts as _interrupts
from ..._base import tree as _tree
from ..._base.distributed import Region, public
from ..._base.env import check
from ..._core import ownership as _ownership
from ..._core import restore as _restore
from ..._errors import (
    CorruptCheckpointError,
    OptionError,
    StructureError,
    UnsupportedLocationError,
)
from ..._format.layout import dtype_from_name, manifest_for_item
from ..._format.steps import holding_checkpoint
from ..._like.onto_like import check_policy
from ..._storage.local_files import fsync_dir
from ..._storage.local_inputs import local_path
from ..._storage.location import Location
from ..._storage.store_errors import arguments, refusals
from ..._storage.untrusted import loads_json, read_capped
from . import remains as _remains
from .headers import MARKER_KEY, MARKER_VALUE, MAX_INDEX_BYTES
from .outputs import (
    Staged,
    check_outputs,
    old_outputs,
    output_names,
    remove_stale,
)
from .plan import (
    EXPORT_OPTIONS,
    ListedKeyMap,
    checked_cast,
    checked_key_map,
    checked_metadata,
    parse_size,
    plan_tensors,
    refuse_over_limit,
    split_shards,
)

DEFAULT_MAX_SHARD_SIZE = "5GB"
_LOCAL_ONLY = "safetensors files are written to local disk; export there, then copy them"


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What :func:`to_safetensors` wrote."""

    files: tuple[str, ...]  # the safetensors files, in order
    index: str | None  # model.safetensors.index.json, when sharded
    tensors: int
    total_bytes: int  # tensor bytes, as the index's total_size


def _unescape(part: str) -> str:
    return part.replace("%2F", "/").replace("%25", "%")


def _checkpoint_leaves(src: Any, limit: int | None) -> tuple[list, Callable]:
    """A checkpoint's leaves and a reader of a group of them."""
    meta = _restore.metadata(src)
    keys = [leaf.path for leaf in meta.leaves.values() if leaf.kind == "prng_key"]
    if keys:
        raise StructureError(
            f"leaf {keys[0]!r}: a PRNG key array has no safetensors equivalent (expected "
            f"numeric arrays, found a typed key); save jax.random.key_data(key) instead"
        )
    leaves = [
        (leaf.path, dtype_from_name(leaf.dtype, path=leaf.path), tuple(leaf.shape))
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
        # host arrays, ``limit`` bytes of reads in flight
        request = _restore.read_request(
            region=Region("export"), partial=True, memory_limit_bytes=limit
        )
        read_alone = _restore.restore_with(src, template, request)
        flat, _ = _tree.flatten(read_alone)
        values = {p: v for p, _, v in flat}
        for path in paths:
            yield path, np.asarray(values.pop(path))

    return leaves, read


def _tree_leaves(tree: Any) -> tuple[list, Callable[[list[str]], Iterator]]:
    flat, _ = _tree.flatten(tree)
    # None and empty nodes (kept as leaves by the tree's flattening) hold no tensor
    values = {p: v for p, _, v in flat if v is not None and not _tree.is_empty_node(v)}
    for p, v in values.items():
        if jax.dtypes.issubdtype(getattr(v, "dtype", None), jax.dtypes.prng_key):
            raise StructureError(
                f"leaf {p!r}: expected an array of numbers, found a PRNG key ({v.dtype}): "
                f"export jax.random.key_data(...) of it instead"
            )
    # by dtype, in this host's byte order (a big-endian array is converted when written)
    leaves = [
        (p, np.asarray(v).dtype.newbyteorder("="), tuple(np.shape(v))) for p, v in values.items()
    ]

    def read(paths):
        for path in paths:
            yield path, np.asarray(values[path])

    return leaves, read


@public(errors=refusals(arguments("source")))  # a store's refusal: StoreAccessError
def to_safetensors(
    source: Any,
    out: Any,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    key_map: Callable[[str], str | None] | None = None,
    transpose_kernels: bool = False,
    dtype: Any = None,
    cast: str = "safe",
    metadata: dict[str, str] | None = None,
    force: bool = False,
    progress: Callable[[int], Any] | None = None,
    memory_limit_bytes: int | None = None,
) -> ExportResult:
    """Writes ``source`` as safetensors, sharded above ``max_shard_size``.

    Args:
      source: a checkpoint of this plugin holding one pytree (e.g. ``DIR/<step>/params``),
        read a group of leaves at a time; or an in-memory pytree of arrays.
      out: ``path/name.safetensors`` (shards are ``name-00001-of-0000N.safetensors``
        with ``name.safetensors.index.json``) or a directory (``model.safetensors``...).
      max_shard_size: bytes or a size such as ``"5GB"`` (10**9) or ``"2GiB"`` (2**30).
      key_map: leaf path (``Dense_0/kernel``) -> tensor name, or None to leave the leaf
        out: a function, or a mapping of the leaves it renames (every key a leaf of
        the source; the others keep their default name). Default: '/' replaced by '.'.
      transpose_kernels: write leaves named ``kernel`` in PyTorch's layout: a Dense
        kernel ``(in, out)`` as ``(out, in)``, a conv kernel ``(*spatial, in, out)``
        as ``(out, in, *spatial)``.
      dtype: cast floating leaves to this floating dtype (e.g. ``"bfloat16"``): values
        are rounded; one that overflows or is not representable is a StructureError
        naming the leaf, as in ``fop.restore``.
      cast: ``"safe"`` (the default: the check above) or ``"unsafe"`` (numpy's cast,
        overflow to inf included).
      metadata: the header's ``__metadata__`` (strings); default ``{"format": "flax"}``,
        ``{"format": "pt"}`` with ``transpose_kernels``.
      force: replace existing output files (and the shards an old index listed);
        without it an existing output is a FileExistsError.
      progress: ``progress(total_bytes)`` returns a context manager with
        ``advance(nbytes, note)`` (the CLI's progress bar).
      memory_limit_bytes: the host-memory ceiling: leaves are read in groups of at most
        this many bytes (default 64 MiB); a leaf larger than it is refused (OptionError)
        before anything is written. None: no ceiling.
    """
    out = local_path(out, what="safetensors output", note=_LOCAL_ONLY)
    limit = parse_size(max_shard_size)
    flags = {"transpose_kernels": transpose_kernels, "force": force, "progress": progress}
    flags["memory_limit_bytes"] = memory_limit_bytes
    check(EXPORT_OPTIONS, flags)
    dtype, metadata = checked_cast(dtype), checked_metadata(metadata)
    check_policy(cast)
    tensors, read = _plan(source, key_map, transpose_kernels, dtype, cast, memory_limit_bytes)
    shards = split_shards(tensors, limit)
    outputs = _outputs(out, len(shards), force)
    if metadata is None:
        metadata = {"format": "pt" if transpose_kernels else "flax"}
    meta = {**metadata, MARKER_KEY: MARKER_VALUE}  # proves, to a later --force, that we wrote it
    return _write(outputs, shards, tensors, read, meta, force, progress, memory_limit_bytes)


def _outputs(out: str, count: int, force: bool) -> tuple[str, list[str], str]:
    """(directory, file names, index name) of an export of ``count`` shards to ``out``."""
    directory, names, index_name = output_names(out, count)
    held = holding_checkpoint(Location.from_path(os.path.realpath(directory)), runs=2)
    if held is not None:
        raise UnsupportedLocationError(
            f"safetensors output {directory}: lies inside {held}; a committed checkpoint "
            f"never changes: write the export elsewhere"
        )
    check_outputs(directory, names, index_name, force)
    return directory, names, index_name


def _plan(source: Any, key_map: Any, transpose_kernels: bool, dtype: Any, cast: str, limit):
    """The tensors an export writes, checked against the ceiling ``limit``, and a reader."""
    key_map = checked_key_map(key_map)
    if isinstance(source, (str, os.PathLike, Location)) or (
        isinstance(source, dict) and "driver" in source  # a kvstore spec
    ):
        leaves, read = _checkpoint_leaves(source, limit)
    else:
        leaves, read = _tree_leaves(source)
    if not leaves:
        raise ValueError("nothing to export: the source holds no array leaves")
    tensors = plan_tensors(leaves, key_map, transpose_kernels, dtype, cast)
    refuse_over_limit(tensors, limit)
    return tensors, read


def _write(outputs: tuple, shards, tensors, read, meta, force, progress, limit) -> ExportResult:
    """Writes the shards, places them, the index, then removes an old export's leftovers;
    on any failure (Ctrl-C too) nothing of it stays."""
    directory, names, index_name = outputs
    finals = [os.path.join(directory, n) for n in names]
    index_path = os.path.join(directory, index_name) if len(shards) > 1 else None
    total = sum(t.nbytes for t in tensors)
    created = _ownership.missing_directories(directory)  # removed again on failure
    os.makedirs(directory, exist_ok=True)
    _remains.remove_dead(directory)  # of an export here that died (its writer is gone)
    staged = Staged(directory, names, shards, meta)  # its marker names this export
    try:
        with contextlib.nullcontext() if progress is None else progress(total) as bar:
            staged.write(tensors, read, bar, group_bytes=limit)
        old = old_outputs(directory, index_name) if force else set()
        for tmp, final in zip(staged.shard_tmps, finals, strict=True):
            staged.place(tmp, final)
        if index_path is not None:
            staged.write_index(tensors, total, index_name, index_path)
        remove_stale(directory, index_name, names, old, force=force, sharded=bool(index_path))
        fsync_dir(directory)
    except BaseException:  # Ctrl-C too: nothing of a failed export stays
        # A second Ctrl-C waits for the clean-up (unlinks: bounded), then is raised.
        with _interrupts.deferred_sigint():
            staged.discard()
            _ownership.remove_created(created)
        raise
    staged.done()
    return ExportResult(tuple(finals), index_path, len(tensors), total)


def export_checkpoint(src: Any, out: Any, **options: Any) -> ExportResult:
    """``flax-orbax export``: :func:`to_safetensors` of one of this plugin's checkpoints;
    the header's metadata names no path (files are published)."""
    src = Location.from_path(src)
    fmt = "pt" if options.get("transpose_kernels") else "flax"
    meta = {"format": fmt, **_provenance(src), "exported_by": "flax-orbax"}
    options.setdefault("metadata", meta)
    return to_safetensors(src, out, **options)


def _provenance(src: Location) -> dict[str, str]:
    """``{"step": "<n>", "item": "<name>"}`` for an item of a committed step, else nothing."""
    manifest = manifest_for_item(src)
    if manifest is None:
        return {}
    name = next(n for n, e in manifest.items.items() if e.dir == src.name)
    return {"step": str(manifest.step), "item": name}


def key_map_from_file(path: str) -> Callable[[str], str | None]:
    """A key_map from a JSON object ``{leaf path: tensor name or null}``."""
    path = local_path(path, what="key map file")
    raw = read_capped(path, follow_links=True, what="key map file", max_bytes=MAX_INDEX_BYTES)
    try:
        mapping = loads_json(raw, path)
    except CorruptCheckpointError as e:
        raise OptionError(str(e)) from None
    if not isinstance(mapping, dict) or not all(
        isinstance(v, str) or v is None for v in mapping.values()
    ):
        raise OptionError(f"{path}: expected a JSON object of leaf path -> tensor name or null")
    return ListedKeyMap(mapping, f"key map file {path}")
