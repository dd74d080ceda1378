"""Reuse in format version 2: whole data files of the previous step, linked or copied.
Called on the background thread of a save, on every process.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._incremental.packed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable

from .._errors import CheckpointError
from .._format.layout import LeafRecord, array_dir
from .._storage import server_copy as _server_copy
from .._storage.location import Location
from .._zarr import chunks as _chunks
from .._zarr import packed_reader as _packed_reader
from .chunks import (
    Refused,
    Writes,
    _Links,
    _same_copy,
    check_linked,
    chunk_file_bytes,
    not_the_snapshot,
    snapshot_crcs,
)

logger = logging.getLogger("flax_orbax_plugin")

LIVE_FRACTION = 0.5  # a previous data file is taken when this share of it is reused


@dataclasses.dataclass(frozen=True)
class Unchanged:
    """An unchanged leaf this process writes: ``j`` its previous number, ``chunks`` of its
    regions, ``writes`` its snapshot, ``nbytes`` those regions' bytes."""

    j: int
    record: LeafRecord
    chunks: list[tuple[str, ...]]
    writes: Writes
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Taken:
    """What :func:`reuse_files` took: data files (name -> size), their segments under this
    step's keys, the leaves held whole, their bytes; ``unchanged``: every one asked about."""

    files: dict[str, int]
    chunks: dict[str, _chunks.Segment]
    leaves: frozenset[int]
    nbytes: int
    unchanged: frozenset[int] = frozenset()


def reuse_files(
    take: Callable[..., None],
    source: Location,
    target: Location,
    process: int,
    unchanged: dict[int, Unchanged],
) -> Taken:
    """Takes the previous data files of ``process`` holding mostly ``unchanged`` leaves into
    ``target`` with ``take`` (:func:`link_file`, :func:`copy_file`); else a Taken of none."""
    none = Taken({}, {}, frozenset(), 0, frozenset(unchanged))
    try:
        previous = _packed_reader.read_index(source, process)
    except (CheckpointError, OSError) as e:
        logger.warning("incremental save: not reusing data files of %s: %s", source, e)
        return none
    segments = _reusable_segments(previous, unchanged)
    files = _files_to_take(previous, segments, unchanged)
    if not files:
        return none
    names = {old: _chunks.data_file_name(process, n) for n, old in enumerate(files)}
    leaves = frozenset(_whole(segments, files, unchanged))
    segments = {key: (i, seg) for key, (i, seg) in segments.items() if i in leaves}
    done: list[str] = []
    try:
        for old, new in names.items():
            live = [s for s in segments.values() if s[1].file == old]
            take(source, target, old, new, previous.files[old], [seg for _, seg in live])
            done.append(new)
    except Exception as e:  # noqa: BLE001  (a failed link or copy never fails the save)
        why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
        logger.warning("incremental save: data files are written, not reused: %s", why)
        _undo(target, done)
        return none
    chunks = {
        key: dataclasses.replace(seg, file=names[seg.file]) for key, (_, seg) in segments.items()
    }
    nbytes = sum(unchanged[i].nbytes for i in leaves)
    files_taken = {names[f]: previous.files[f] for f in files}
    return Taken(files_taken, chunks, leaves, nbytes, frozenset(unchanged))


def _reusable_segments(
    previous: _chunks.DataIndex, unchanged: dict[int, Unchanged]
) -> dict[str, tuple[int, _chunks.Segment]]:
    """``{new key: (leaf, previous segment)}`` of the leaves whose every chunk the index
    lists with a chunk's size and the snapshot's crc32c."""
    out: dict[str, tuple[int, _chunks.Segment]] = {}
    for i, leaf in unchanged.items():
        size = chunk_file_bytes(leaf.record)
        try:
            crcs = snapshot_crcs(leaf.record, leaf.writes, leaf.chunks) if size else {}
        except Refused:
            continue
        mine = {}
        for parts in leaf.chunks:
            name = "/".join(parts)
            seg = previous.chunks.get(f"{array_dir(leaf.j)}/{name}")
            if seg is None or seg.length != size:
                break
            if seg.crc32c != crcs[parts]:
                shown = f"{array_dir(leaf.j)}/{name} ({_chunks.DATA_DIR}/{seg.file})"
                logger.warning(
                    "incremental save: leaf %r is written: %s",
                    leaf.record.path,
                    not_the_snapshot(shown, seg.crc32c, crcs[parts]),
                )
                break
            mine[f"{array_dir(i)}/{name}"] = (i, seg)
        else:
            if leaf.chunks:
                out.update(mine)
    return out


def _whole(segments, files: list[str], unchanged: dict[int, Unchanged]) -> set[int]:
    """The leaves whose every chunk lies in one of ``files``."""
    out = {i for i, _ in segments.values()}
    for i, seg in segments.values():
        if seg.file not in files:
            out.discard(i)
    return out & set(unchanged)


def _files_to_take(previous: _chunks.DataIndex, segments, unchanged) -> list[str]:
    """The previous data files at least LIVE_FRACTION live (leaves held whole), to a fixed
    point (dropping a file may drop a leaf it shares)."""
    files = list(previous.files)
    while True:
        whole = _whole(segments, files, unchanged)
        live: dict[str, int] = {}
        for i, seg in segments.values():
            if i in whole:
                live[seg.file] = live.get(seg.file, 0) + seg.length
        kept = [f for f in files if live.get(f, 0) and live[f] >= LIVE_FRACTION * previous.files[f]]
        if kept == files:
            return files
        files = kept


def link_file(
    source: Location,
    target: Location,
    old: str,
    new: str,
    size: int,
    live: list[_chunks.Segment],
) -> None:
    """Hard-links ``data/<old>`` of ``source`` as ``data/<new>`` of ``target`` (no symlink
    followed), then checks it (size, every ``live`` segment's crc32c); raises after
    unlinking it on any failure."""
    os.makedirs(target.path, exist_ok=True)  # another process may not have yet
    links, shown = _Links(source, target), f"{source}/data/{old}"
    try:
        dfd = links.link((_chunks.DATA_DIR,), old, (_chunks.DATA_DIR,), new, shown)
        segments = [(f"{shown} at {s.offset}", s.offset, s.length, s.crc32c) for s in live]
        check_linked(dfd, new, shown, size, segments, _differs)
    except BaseException:
        links.undo()
        raise
    finally:
        links.close()


def _differs(where: str, stored: int, expected: int) -> str:
    return f"{where}: its crc32c differs from its index's"


def copy_file(
    copier: _server_copy.Copier,
    source: Location,
    target: Location,
    old: str,
    new: str,
    size: int,
    live: list[_chunks.Segment],
) -> None:
    """Server-side copy of ``data/<old>`` as ``target``'s ``data/<new>``, checked (else deleted)."""
    if source.spec | {"path": ""} != target.spec | {"path": ""}:
        raise Refused(f"{target}: not in the bucket of {source}")
    src = f"{source.path}{_chunks.DATA_DIR}/{old}"
    dst = f"{target.path}{_chunks.DATA_DIR}/{new}"
    info = copier.list(src).get(src)
    if info is None or info.size != size:
        raise Refused(f"{source}/data/{old}: expected {size} bytes, found {info}")
    try:
        answer = copier.copy(src, dst, info)
        if not _same_copy(info, answer, copier.list(dst).get(dst)):
            raise Refused(f"{target}/data/{new}: the copy is not the object {src} listed")
    except BaseException:
        with contextlib.suppress(OSError):
            copier.delete(dst)
        raise


def _undo(target: Location, names: list[str]) -> None:
    """Removes the data files this call took (its own names in the staging item)."""
    for name in names:
        with contextlib.suppress(OSError, CheckpointError):
            target.delete(f"{_chunks.DATA_DIR}/{name}")
