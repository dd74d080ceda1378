"""The background phase's data in format version 2: this process's chunks packed into a
few data files of its item, and their index (``_zarr.packed_writer``).

No ``zarr.json`` is written and nothing goes through tensorstore's zarr driver: every
region is whole chunks (the plan aligns them), written by one :class:`PackedWriter`,
each write one pending future drained to the memory limit as in version 1. An
incremental step first takes the previous step's data files that hold mostly unchanged
leaves (``_incremental.packed``) and writes the other leaves after them. Called on the
save's background thread.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from .._base import liveness as _liveness
from .._errors import CheckpointError
from .._format.layout import ArrayStorage, BatchRecord, array_dir, batch_dir, sha256
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunk_writer as _chunk_writer
from .._zarr import chunks as _chunks
from .._zarr import packed_codec as _codec
from .._zarr import packed_writer as _packed_writer
from .._zarr import subbyte as _subbyte
from .write_data import _batch_jobs, _Pending, _raise_as_checkpoint_error, _settle


def write_packed(
    staging: Location,
    leaves: list,
    batches: dict[str, BatchRecord],
    batch_data: dict[str, Any],
    *,
    process: int,
    limit: int,
    data_file_bytes: int | None = None,
    budget: int | None = None,
    reuse: Callable[[], Any] | None = None,
    cancelled: threading.Event | None = None,
) -> tuple[int, dict[str, str], int]:
    """Writes this process's chunks into its data files and its index; returns (bytes
    written, {index file: sha256}, bytes reused). Takes the batches it writes out of
    ``batch_data``. ``reuse()``: the previous data files taken (a ``Taken``).
    ``budget``: the host-memory budget (on an object store, the data files gathered in
    memory before their upload stay within a quarter of it)."""
    if sys.byteorder != "little":
        raise CheckpointError("format_version=2 is written on little-endian hosts only")
    total = sum(data.nbytes for leaf in leaves for _, data in leaf.writes)
    total += sum(data.nbytes for data in batch_data.values())
    taken = None if reuse is None else reuse()
    writer = _packed_writer.PackedWriter(
        staging,
        process,
        data_file_bytes,
        total,
        gathered_bytes=None if budget is None else budget // 4,
    )
    stable: frozenset[int] = frozenset()
    if taken is not None:
        writer.adopt(taken.files, taken.chunks)
        stable = taken.unchanged - taken.leaves
        for leaf in leaves:
            if leaf.index in taken.leaves:
                leaf.writes.clear()  # drop the snapshot: the data file taken holds it
    # Unchanged leaves not taken first, side by side: their files can be taken next time.
    ordered = sorted(leaves, key=lambda leaf: leaf.index not in stable)
    jobs = [
        (None, leaf.writes, _direct(writer, leaf))
        for leaf in ordered
        if isinstance(leaf.record.storage, ArrayStorage) and leaf.writes
    ]
    plain = [(name, None) for name, b in batches.items() if b.codec is None]
    jobs += _batch_jobs(plain, batches, batch_data, writer)
    jobs += _compressed_batch_jobs(batches, batch_data, writer)
    pending = _Pending(limit, cancelled)
    doing = pending.report(total)  # bytes done and left, in this process's heartbeat
    try:
        try:
            pending.write_all(jobs)
            pending.drain(0)
        finally:
            writer.close()
            _liveness.ACTIVITIES.end(doing)
    except BaseException as e:
        _settle(pending.futures)
        _raise_as_checkpoint_error(e, staging, direct=True)
        raise
    name, raw = writer.write_index(_dtypes(leaves, batches))
    return pending.written, {name: sha256(raw)}, 0 if taken is None else taken.nbytes


def _dtypes(leaves: list, batches: dict[str, BatchRecord]) -> dict[str, str]:
    """The stored dtype of every array and batch (the index records those it holds)."""
    out = {batch_dir(name): b.dtype for name, b in batches.items()}
    for leaf in leaves:
        if isinstance(leaf.record.storage, ArrayStorage):
            out[array_dir(leaf.index)] = _subbyte.stored(leaf.record).dtype
    return out


def _compressed_batch_jobs(batches: dict[str, BatchRecord], batch_data, writer) -> list:
    """The jobs of this process's compressed batches (each encoded whole in memory)."""
    jobs = []
    for name, batch in batches.items():
        if batch.codec is not None and name in batch_data:
            data = batch_data.pop(name)
            if isinstance(data, _chunk_writer.Gathered):
                data = data.assemble()
            spec = _arrays.batch_spec(_codec.MEMORY, batch)
            sub = batch_dir(name)
            write = lambda index, data, sub=sub, spec=spec: [
                writer.encoded(sub, spec, [(index, data)])
            ]
            jobs.append((None, [((slice(None),), data)], write))
    return jobs


def _direct(writer: _packed_writer.PackedWriter, leaf):
    record = leaf.record
    chunk = record.storage.chunk_shape
    spec = None
    if record.storage.codec is not None:
        spec = _arrays.leaf_spec(_codec.MEMORY, leaf.index, record)

    def write(index, data):
        sub = array_dir(leaf.index)
        if spec is None:
            futures = writer.array(sub, record.shape, chunk, index, data, leaf.crcs)
        else:
            whole = _chunks.whole_chunks(record.shape, chunk, index)
            ok = whole is not None and data.shape == whole[0]
            futures = [writer.encoded(sub, spec, [(index, data)])] if ok else None
        if futures is None:
            raise CheckpointError(
                f"leaf {record.path!r}: a region {index} that is not whole chunks of "
                f"{record.storage.chunk_shape}; format_version=2 stores whole chunks only"
            )
        return futures

    return write
