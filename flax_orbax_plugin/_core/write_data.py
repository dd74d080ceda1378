"""The background phase's data: the files this process writes in format version 2
(:func:`write_packed`, the default), and the writes in flight both formats bound
(:class:`WritesInFlight`; version 1's write is ``format_v1``'s).

Called on the save's background thread, as the format seam (``formats``) picks. On any
failure no write is left in flight.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.write_data``.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable
from typing import Any

from .._base import env as _env
from .._base import host as _host
from .._errors import CheckpointError
from .._format.layout import ArrayStorage, BatchRecord, array_dir, batch_dir, sha256
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunks as _chunks
from .._zarr import packed_codec as _codec
from .._zarr import packed_writer as _packed_writer
from .._zarr import subbyte as _subbyte
from . import host_snapshot as _host_snapshot
from .handle import raise_if_cancelled


def batch_jobs(batch_specs, batches, batch_data, writer) -> list:
    """The jobs of the batches this process writes (those in ``batch_data``)."""
    jobs = []
    for name, spec in batch_specs:
        if name in batch_data:
            data = batch_data.pop(name)
            if writer is not None and batches[name].codec is None:
                jobs.append((spec, [((slice(None),), data)], _direct_batch(writer, name, batches)))
            else:
                jobs.append((spec, [((slice(None),), _assembled(data))], None))
    return jobs


def _assembled(data: Any) -> Any:
    """A batch whole in one buffer (its leaves' ``Gathered`` pieces copied together)."""
    return data.assemble() if isinstance(data, _packed_writer.Gathered) else data


def _direct_batch(writer: _packed_writer.ChunkWriter, name: str, batches):
    batch = batches[name]
    return lambda index, data: writer.batch(batch_dir(name), batch.chunk, batch.inner, data)


class WritesInFlight:
    """Writes in flight (future, bytes), drained whenever more than ``limit`` bytes are
    (the host-memory budget); ``written`` counts the bytes handed out."""

    def __init__(self, limit: int, cancelled: threading.Event | None = None):
        self.limit = limit
        self.cancelled = cancelled
        self.futures: collections.deque = collections.deque()
        self.in_flight = 0
        self.written = 0
        self.progress = _host.Progress()

    def report(self, total: int):
        """Begins this thread's activity "writing this process's data" of ``total``
        bytes, whose progress (:attr:`progress`) the heartbeat publishes; the caller
        ends it (``_host.ACTIVITIES.end``)."""
        doing = _host.ACTIVITIES.begin("writing this process's data", moving=True)
        self.progress = doing.progress
        self.progress.total = total
        return doing

    def fail(self, error: BaseException, staging: Location, *, direct: bool) -> None:
        """After ``error``: waits for every write in flight (none may recreate files after
        a cleanup), then raises ``error`` as a CheckpointError where it is one
        (tensorstore's ValueError; an OSError of the direct writer); returns for any other."""
        settle(self.futures)
        if isinstance(error, ValueError):  # tensorstore's status text, with its whole spec
            text = str(error).split(" [tensorstore_spec=", 1)[0]
            raise CheckpointError(f"writing array data to {staging} failed: {text}") from error
        if isinstance(error, OSError) and direct:
            raise CheckpointError(f"writing array data to {staging} failed: {error}") from error

    def drain(self, to: int) -> None:
        """Waits for the oldest writes until at most ``to`` bytes are in flight, and
        settles those already done (their bytes count as progress at once)."""
        while self.futures and (self.in_flight > to or self.futures[0][0].done()):
            future, nbytes = self.futures.popleft()
            future.result()
            self.in_flight -= nbytes
            self.progress.done = self.written - self.in_flight

    def write_all(self, jobs: list) -> None:
        for spec, writes, direct in jobs:
            self._write(spec, writes, direct)

    def _write(self, spec, writes: list, direct) -> None:
        """Writes every region of one job (popped from ``writes``: each snapshot buffer
        is released once its write is done)."""
        store = None
        while writes:
            raise_if_cancelled(self.cancelled, "the save, while writing its data,")
            index, data = writes.pop()
            data = _host_snapshot.materialize(data)  # a region still on its device: copied now
            if data.size:
                futures = direct(index, data) if direct is not None else None
                if futures is None:
                    if store is None:
                        store = _arrays.open_for_write(spec)
                    stored = _arrays.as_stored(data, store.dtype.numpy_dtype)
                    write = store[index].write(stored, can_reference_source_data_indefinitely=True)
                    futures = [write.commit]
                share = data.nbytes // max(1, len(futures))
                self.futures.extend((future, share) for future in futures)
                self.in_flight += share * len(futures)
                self.written += data.nbytes
                if self.written == data.nbytes:
                    _env.kill_point("mid_write")
                    _env.pause_point("mid_write")
                _env.slow_point("write")  # tests: a slow but progressing write
            del data
            self.drain(self.limit)


def settle(pending) -> None:
    """Waits for every future, ignoring their errors (the first error is the one raised)."""
    for future, _ in pending:
        try:
            future.result()
        except Exception:  # noqa: BLE001
            pass


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
    gathered = None if budget is None else budget // 4
    writer = _packed_writer.PackedWriter(
        staging, process, data_file_bytes, total, gathered_bytes=gathered
    )
    jobs = _packed_jobs(writer, taken, leaves, batches, batch_data)
    pending = WritesInFlight(limit, cancelled)
    doing = pending.report(total)  # bytes done and left, in this process's heartbeat
    try:
        try:
            pending.write_all(jobs)
            pending.drain(0)
        finally:
            writer.close()
            _host.ACTIVITIES.end(doing)
    except BaseException as e:
        pending.fail(e, staging, direct=True)
        raise
    name, raw = writer.write_index(_dtypes(leaves, batches))
    return pending.written, {name: sha256(raw)}, 0 if taken is None else taken.nbytes


def _packed_jobs(writer: _packed_writer.PackedWriter, taken, leaves, batches, batch_data) -> list:
    """The jobs of a packed write: the previous step's data files ``taken`` adopted (their
    leaves not written), the unchanged leaves not taken first, side by side (their files
    can be taken next time), then the other leaves and the batches."""
    stable: frozenset[int] = frozenset()
    if taken is not None:
        writer.adopt(taken.files, taken.chunks)
        stable = taken.unchanged - taken.leaves
        for leaf in leaves:
            if leaf.index in taken.leaves:
                leaf.writes.clear()  # drop the snapshot: the data file taken holds it
    jobs = [
        (None, leaf.writes, _direct(writer, leaf))
        for leaf in sorted(leaves, key=lambda leaf: leaf.index not in stable)
        if isinstance(leaf.record.storage, ArrayStorage) and leaf.writes
    ]
    plain = [(name, None) for name, b in batches.items() if b.codec is None]
    jobs += batch_jobs(plain, batches, batch_data, writer)
    return jobs + _compressedbatch_jobs(batches, batch_data, writer)


def _dtypes(leaves: list, batches: dict[str, BatchRecord]) -> dict[str, str]:
    """The stored dtype of every array and batch (the index records those it holds)."""
    out = {batch_dir(name): b.dtype for name, b in batches.items()}
    for leaf in leaves:
        if isinstance(leaf.record.storage, ArrayStorage):
            out[array_dir(leaf.index)] = _subbyte.stored(leaf.record).dtype
    return out


def _compressedbatch_jobs(batches: dict[str, BatchRecord], batch_data, writer) -> list:
    """The jobs of this process's compressed batches (each encoded whole in memory)."""
    jobs = []
    for name, batch in batches.items():
        if batch.codec is not None and name in batch_data:
            data = _assembled(batch_data.pop(name))
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
