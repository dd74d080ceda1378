"""Format version 1 (one file per chunk, a ``zarr.json`` per array and batch): its
``Format`` (:data:`CHUNK_FILES`) and its write; the seam is ``formats``.

Called on the save's background thread (write) and the restoring thread (reads).
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

from .._base import env as _env
from .._base import host as _host
from .._format import layout as _layout
from .._format.layout import ArrayStorage, BatchRecord, CheckpointDocument, array_dir
from .._incremental import reuse as _reuse
from .._incremental.reuse import copy_leaf, link_leaf
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunk_files as _chunk_files
from .._zarr import packed_writer as _packed_writer
from . import host_snapshot as _host_snapshot
from . import reads as _reads
from .reads import check_claims

ONE_FILE_PER_CHUNK = "format_version=2 (version 1 writes one file per chunk)"


class ChunkFiles:
    """Version 1: one file per chunk and a ``zarr.json`` per array and batch."""

    version = 1
    copies_before_writing = False
    per_host_directories = True
    ignored_options = (("data_file_bytes", ONE_FILE_PER_CHUNK),)
    batch_damage: tuple[type[BaseException], ...] = ()
    array_specs = True

    def write(
        self, snap: Any, location: Location, leaves: list, *, primary: bool, found: Any
    ) -> tuple:
        links = {} if found is None else _links(location, *found)
        written, reused = write_data(location, leaves, snap, primary=primary, links=links)
        return written, {}, reused

    def reuser(self, location: Location) -> Any:
        return _reuse.reuser(location, link=link_leaf, copy=copy_leaf)

    def wrote(self, doc: CheckpointDocument) -> bool:
        return doc.format_version == 1

    def open(self, location: Location, doc: CheckpointDocument, targets: list, *, own_copy: bool):
        check_claims(location, doc, targets, own_copy=own_copy)
        return _chunk_files.ChunkReader(location.path) if _chunk_files.usable(location) else None

    def array_store(self, location: Location, target: Any, paths: list[str]) -> Any:
        spec = _arrays.leaf_spec(location, target.index, target.record)
        return _reads.opened(_arrays.open_for_read(spec), location, paths)

    def read_stored(self, store: Any, index: int, record: Any, direct: Any, region: Any) -> Any:
        read = _reads.plain_read(index, record, direct, region)
        if read is not None:
            return read
        dtype = _layout.dtype_from_name(record.dtype, path=record.path)
        return _reads.ReadInto(store if region is None else store[region], dtype)

    def batch_store(self, location: Location, batch: BatchRecord, direct, paths) -> Any:
        spec = _arrays.batch_spec(location, batch)
        return _reads.opened(_arrays.open_for_read(spec), location, paths)

    def reads_batch_runs(self, direct: Any, batch: BatchRecord) -> bool:
        return direct is not None and batch.codec is None

    def check_lengths(self, location: Location, direct: Any) -> None:
        pass  # each chunk file's length is checked by its read (its crc32c trailer last)


def _links(location: Location, way, source: Location, unchanged: list) -> dict[int, Any]:
    """``{leaf index: link()}``: links or copies the leaf's chunks; the bytes reused or None."""
    return {
        leaf.index: functools.partial(
            way,
            source,
            j,
            location,
            leaf.index,
            leaf.record,
            chunks=chunks,
            nbytes=sum(data.nbytes for _, data in leaf.writes),
            writes=leaf.writes,  # the snapshot, which each reused chunk must equal
        )
        for leaf, j, chunks in unchanged
    }


_LEAVES_COPIED_AT_ONCE = 4  # object stores: leaves whose chunks are copied concurrently


def write_data(
    staging: Location, leaves: list, snap: Any, *, primary: bool, links: dict[int, Any]
) -> tuple[int, int]:
    """This process's chunks written, ``links`` reused: (bytes written, bytes reused)."""
    batches = snap.batches
    arrays = [
        (leaf, _arrays.leaf_spec(staging, leaf.index, leaf.record))
        for leaf in leaves
        if isinstance(leaf.record.storage, ArrayStorage)
    ]
    batch_specs = [(name, _arrays.batch_spec(staging, b)) for name, b in batches.items()]
    if primary:
        _create(arrays + batch_specs)
    # links or copies on helper threads beside the writes (one that fails: written after)
    linking = [(leaf, spec) for leaf, spec in arrays if leaf.index in links and leaf.writes]
    linker, linked = _start_links(staging, linking, links)
    # local plain arrays and batches: ChunkFileWriter; the rest, or a region it declines: ts
    writer = _packed_writer.ChunkFileWriter(staging.path) if _chunk_files.usable(staging) else None
    jobs = [
        _array_job(leaf, spec, writer)
        for leaf, spec in arrays
        if leaf.writes and leaf.index not in links
    ]
    jobs += _host_snapshot.batch_jobs(batch_specs, batches, snap.batch_data, writer)
    pending = _host_snapshot.WritesInFlight(snap.request.limit, snap.request.cancelled)
    total = sum(int(getattr(d, "nbytes", 0) or 0) for _, writes, _ in jobs for _, d in writes)
    doing = pending.report(total)
    try:
        pending.write_all(jobs)
        reused = _write_unlinked(pending, linking, linked, writer)
        pending.drain(0)
    except BaseException as e:
        pending.fail(e, staging, direct=writer is not None)
        raise
    finally:
        _host.ACTIVITIES.end(doing)
        if writer is not None:
            writer.close()
        if linker is not None:
            linker.shutdown(wait=True, cancel_futures=True)  # none after a failure's cleanup
    return pending.written, reused


def _start_links(staging: Location, linking: list, links: dict[int, Any]):
    """(the helper pool, one future per leaf of ``linking``), or (None, []) for none."""
    if not linking:
        return None, []
    workers = 1 if staging.is_local else _LEAVES_COPIED_AT_ONCE
    linker = concurrent.futures.ThreadPoolExecutor(  # hard links alone may be lowered
        workers,
        thread_name_prefix="fop-link",
        initializer=_env.initializer(local_only=staging.is_local),
    )
    return linker, [linker.submit(links[leaf.index]) for leaf, _ in linking]


def _write_unlinked(
    pending: _host_snapshot.WritesInFlight, linking: list, linked: list, writer
) -> int:
    """Writes the leaves whose link or copy failed; returns the bytes the others reused."""
    jobs, reused = [], 0
    for (leaf, spec), future in zip(linking, linked, strict=True):
        nbytes = future.result()
        if nbytes is None:
            jobs.append(_array_job(leaf, spec, writer))
        else:
            reused += nbytes
            leaf.writes.clear()  # drop the snapshot: the previous step has it
    pending.write_all(jobs)
    return reused


def _create(specs: list) -> None:
    """Creates every array's zarr.json (the primary, before any chunk is written)."""
    creates = [_arrays.create(spec) for _, spec in specs]
    try:
        for future in creates:
            future.result()
    except BaseException:
        _host_snapshot.settle((f, 0) for f in creates)  # none may recreate files after a cleanup
        raise


def _array_job(leaf, spec, writer: _packed_writer.ChunkWriter | None):
    """(spec, writes, direct write or None) of a leaf stored as its own array."""
    record = leaf.record
    if writer is None or record.storage.codec is not None:
        return spec, leaf.writes, None

    def direct(index, data):
        return writer.array(
            array_dir(leaf.index), record.shape, record.storage.chunk_shape, index, data, leaf.crcs
        )

    return spec, leaf.writes, direct


CHUNK_FILES = ChunkFiles()
