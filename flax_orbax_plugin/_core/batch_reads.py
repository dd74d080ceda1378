"""Reading a restore's leaves out of one batch (thousands of small leaves in one 1-D
array of files of checksummed inner chunks).

On a local disk without compression (format version 1) the needed leaves are read
as runs of whole inner chunks, file by file, straight into one buffer; each file's
leaves are placed as soon as that file is read, while the reader's threads read the
next files. A run reads only the inner chunks that hold needed leaves (params of a
train state: about their bytes, not the whole batch). Elsewhere: the whole batch at
once when most of it is needed, else leaf by leaf. A damaged file is located to its
leaves by reading them one by one. Threading: calling thread (see ``reads``).
"""

from __future__ import annotations

import numpy as np

from .._format import layout as _layout
from .._format.layout import BatchRecord, batch_dir
from .formats import read_slice
from .reads import Reader, ReadInto, corrupt
from .targets import Target, finish

# Needed leaves closer than this many inner chunks are read as one run (the gap is
# read too: one request instead of two).
RUN_GAP_INNER_CHUNKS = 1


class _Batch:
    """One batch's reads for a restore: the leaves wanted, how to read one alone."""

    def __init__(self, reader: Reader, location, batch: BatchRecord, fail, errors, direct):
        self.reader, self.location, self.batch = reader, location, batch
        self.fail, self.errors, self.direct = fail, errors, direct
        self.dtype = _layout.dtype_from_name(batch.dtype)
        self.store = None

    def read_each(self, targets: list[Target]) -> None:
        """One read per leaf (tensorstore, or the packed reader's batch files)."""
        for target in targets:
            off, size = target.record.storage.offset, target.record.storage.size

            def done(data, target=target):
                finish(target, data, self.reader.placer)

            self.reader.submit(
                ReadInto(self.store[off : off + size], self.dtype)
                if self.store is not None
                else read_slice(self.direct, self.batch, off, size),
                size * self.dtype.itemsize,
                done,
                self.fail([target.record.path]),
            )

    def locate(self, targets: list[Target], error: Exception) -> None:
        """After ``error`` reading ``targets`` together: reads them one by one to name
        the damaged ones (all of them where no single read fails)."""
        errors, before = self.errors, len(self.errors)
        self.read_each(targets)
        self.reader.drain(0)
        if len(errors) == before:
            errors.append(corrupt([t.record.path for t in targets], self.location, error))
        else:
            bad = [str(e) for e in errors[before:]]
            del errors[before:]
            paths = [t.record.path for t in targets if any(repr(t.record.path) in b for b in bad)]
            errors.append(corrupt(paths, self.location, error))


def read_batch(reader: Reader, location, batch: BatchRecord, members, fail, errors, fmt, direct):
    """Reads the ``members`` (targets) of ``batch`` in format ``fmt`` through ``direct``
    (its reader); damage goes to ``errors`` (via ``fail(paths)``), naming the leaves."""
    one = _Batch(reader, location, batch, fail, errors, direct)
    paths = [t.record.path for t in members]
    try:
        one.store = fmt.batch_store(location, batch, direct, paths)
    except fmt.batch_damage as e:  # version 2: a shard missing, too long, not its index's
        errors.append(corrupt(paths, location, e))
        return
    if fmt.reads_batch_runs(direct, batch):
        for target in members:
            if not target.record.storage.size:  # nothing stored
                finish(target, np.empty(0, one.dtype), reader.placer)
        stored = [t for t in members if t.record.storage.size]
        for run in _runs(stored, batch.inner):
            _read_run(one, run)
        return
    if sum(t.record.storage.size for t in members) * 2 < batch.size:
        one.read_each(members)
        return

    def done_all(data):
        for target in members:
            off, size = target.record.storage.offset, target.record.storage.size
            finish(target, data[off : off + size], reader.placer)

    if direct is not None and batch.codec is None:
        sub, inner = batch_dir(batch.name), batch.inner
        whole = direct.read_batch(sub, batch.size, int(batch.chunk), inner, one.dtype)
    else:
        whole = ReadInto(one.store, one.dtype)
    reader.submit(
        whole, batch.size * one.dtype.itemsize, done_all, lambda e: one.locate(members, e)
    )


def _runs(members: list[Target], inner: int) -> list[list[Target]]:
    """The members by offset, in runs whose gaps are under ``RUN_GAP_INNER_CHUNKS``
    inner chunks."""
    ordered = sorted(members, key=lambda t: t.record.storage.offset)
    runs: list[list[Target]] = []
    stop = 0
    for target in ordered:
        off, size = target.record.storage.offset, target.record.storage.size
        if not runs or off > stop + RUN_GAP_INNER_CHUNKS * inner:
            runs.append([])
        runs[-1].append(target)
        stop = max(stop, off + size)
    return runs


class _FilePart:
    """The ``k``-th file of a ranged batch read, as a future of the whole buffer."""

    def __init__(self, read, k: int):
        self.read, self.k = read, k

    def result(self) -> np.ndarray:
        self.read.futures[self.k].result()
        return self.read.out


def _read_run(one: _Batch, run: list[Target]) -> None:
    """Reads the inner chunks under one run of leaves; each file's leaves (those that
    end in it) are finished once it is read, unless a file they touch failed."""
    batch, chunk = one.batch, int(one.batch.chunk)
    start = run[0].record.storage.offset
    stop = max(t.record.storage.offset + t.record.storage.size for t in run)
    inner = batch.inner
    read = one.direct.read_batch_range(
        batch_dir(batch.name), batch.size, chunk, inner, one.dtype, start, stop
    )
    by_file: dict[int, list[Target]] = {}
    for target in run:
        off, size = target.record.storage.offset, target.record.storage.size
        by_file.setdefault((off + size - 1) // chunk, []).append(target)
    failed: dict[int, Exception] = {}

    def done(data, s):
        good, hit = [], []
        for target in by_file.get(s, []):
            first = target.record.storage.offset // chunk
            (hit if any(f in failed for f in range(first, s + 1)) else good).append(target)
        for target in good:
            off = target.record.storage.offset - read.first
            finish(target, data[off : off + target.record.storage.size], one.reader.placer)
        if hit:
            one.locate(hit, next(failed[f] for f in sorted(failed)))

    def failed_file(error, s):
        failed[s] = error
        if by_file.get(s):
            one.locate(by_file[s], error)

    for k, s in enumerate(read.files):
        nbytes = (read.ends[k] - max(read.first, s * chunk)) * one.dtype.itemsize
        one.reader.submit(
            _FilePart(read, k),
            nbytes,
            lambda data, s=s: done(data, s),
            lambda error, s=s: failed_file(error, s),
        )
