"""Restoring a pytree of ours onto a ``like`` template (or its plan), down to the reads of
its targets through the format (a leaf surgery made: from the saved leaves it covers).

Threading: reads are issued from the calling thread, whose callbacks run on it too; the
host-memory budget bounds the bytes of reads in flight.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.restore``.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import host as _host
from .._base import tree as _tree
from .._base.env import Option, check, flag
from .._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StructureError,
    TransformError,
)
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import ArrayStorage, BatchRecord, BatchStorage, CheckpointDocument, batch_dir
from .._format.steps import STEP_OR_NONE, read_document
from .._like import onto_like as _onto_like
from .._like import surgery as _surgery
from .._like.surgery import Piece, PlanEntry, RestorePlan, full_box
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunk_files as _chunk_files
from .._zarr import chunks as _chunks
from .._zarr import subbyte as _subbyte
from . import formats as _formats
from .reads import (
    DEFAULT_READ_LIMIT_BYTES,
    Reader,
    ReadInto,
    ReadRequest,
    Target,
    add_missing_empties,
    agree_on_read,
    corrupt,
    deleted_or,
    finish,
    make_target,
    opened,
    read_slice,
    sharding_of,
)

RESTORE: tuple[Option, ...] = (
    _formats.MEMORY_LIMIT,
    Option("share_replicated_reads", "flag", none_ok=True, expected="True, False or None"),
)


SERVING: tuple[Option, ...] = (STEP_OR_NONE, Option("item", "str"), _formats.MEMORY_LIMIT)


RUN_GAP_INNER_CHUNKS = 1  # leaves closer than this many inner chunks: one read (gap too)


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
            self.reader.submit(
                read_slice(self.store, self.direct, self.batch, off, size),
                size * self.dtype.itemsize,
                lambda data, target=target: finish(target, data, self.reader.placer),
                self.fail([target.record.path]),
            )

    def locate(self, targets: list[Target], error: Exception) -> None:
        """After ``error`` reading ``targets`` together: each read alone names the damaged."""
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
    """Reads the ``members`` of ``batch`` through ``direct``; damage goes to ``errors``."""
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
    """The members by offset, in runs with gaps of at most ``RUN_GAP_INNER_CHUNKS``."""
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
    """The ``k``-th file of a ranged batch read, a future of the whole buffer."""

    def __init__(self, read, k: int):
        self.read, self.k = read, k

    def result(self) -> np.ndarray:
        self.read.futures[self.k].result()
        return self.read.out


def _read_run(one: _Batch, run: list[Target]) -> None:
    """Reads one run; a leaf is finished with the file it ends in, unless one failed."""
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


def read_targets(location: Location, doc: CheckpointDocument, targets: list, request: ReadRequest):
    """Reads every target; collective reads agree on their outcome before any all-gather."""
    collective = _collective(targets, request.share_reads)
    error = None
    shared: list = []
    try:
        shared = _read_targets_inner(location, doc, targets, request)
    except (CorruptCheckpointError, CheckpointNotFoundError) as e:  # or the checkpoint gone
        error = deleted_or(location, e)
    except Exception as e:  # noqa: BLE001  (re-raised below, after the agreement)
        error = e
    if collective:
        where = f"restore of {location}"
        request.region.agree("restore-read", error, what=where)
    elif error is not None:
        raise error
    for target, sharding in shared:  # collective, in the same order on every process
        target.result = _replicate(sharding)(target.result)


def spans_processes(*trees: Any) -> bool:
    """Whether a sharding in ``trees`` places data on other processes' devices."""
    if jax.process_count() == 1:
        return False
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
    for leaf in jax.tree_util.tree_leaves(trees, is_leaf=is_sharding):
        found = leaf if is_sharding(leaf) else getattr(leaf, "sharding", None)
        if isinstance(getattr(found, "mesh", None), jax.sharding.AbstractMesh):
            mesh = jax.sharding.get_mesh()  # set_mesh's, onto which the read places it
            if not mesh.empty and not mesh.is_multi_process:
                continue
            return not mesh.empty  # none: refused by the read, naming the leaf
        if is_sharding(found) and not found.is_fully_addressable:
            return True
    return False


def _collective(targets: list, share_reads: bool) -> bool:
    """Whether reading ``targets`` is collective; the same on every process."""
    if not share_reads or _distributed.process_count() == 1:
        return False
    for t in targets:
        if t.record.kind in _layout.NO_DATA_KINDS:
            continue
        sharding = sharding_of(t)
        if sharding is not None and not sharding.is_fully_addressable:
            return True
        batched = isinstance(t.record.storage, BatchStorage)
        if not batched and _shared_read_sharding(sharding, t.record.shape) is not None:
            return True
    return False


def _read_targets_inner(location, doc: CheckpointDocument, targets: list, request: ReadRequest):
    fmt = _formats.of_document(doc)  # picked once, from the metadata
    checked = targets + sources(targets)  # the saved leaves surgery's leaves read: checked too
    alone = not request.own_copy and _steps.in_host_copy(location)  # one host's copy, alone
    copy = _steps.of_item(location) if alone else None
    partial = [] if copy is None else copy.partial(location.name, [t.record for t in checked])
    if partial:  # one host's copy (a directory per host) never passes for the whole
        raise copy.refusal(location, partial)
    direct = fmt.open(location, doc, checked, own_copy=request.own_copy)
    try:
        with _host.ACTIVITIES.doing(f"reading {location}", moving=True) as progress:
            return _read_targets_with(location, doc, targets, request, fmt, direct, progress)
    finally:
        if direct is not None:
            direct.close()


def read_region(fmt, store, target: Target, direct, region=None):
    """A read of ``region`` (global; None: all) of one target's stored array."""
    record = target.record
    if target.virtual is not None:  # made by surgery: ``store`` reads the saved leaves
        return VirtualRead(target.virtual, region, store)
    if _chunks.is_packed(record):
        inner, width, skip = _subbyte.stored_region(record, region)
        read = fmt.read_stored(store, target.index, _subbyte.stored(record), direct, inner)
        return _subbyte.Unpacked(read, record, width, skip)
    return fmt.read_stored(store, target.index, record, direct, region)


def _read_targets_with(location, doc, targets, request: ReadRequest, fmt, direct, progress):
    reader = Reader(request.memory_limit_bytes, progress)  # progress: read by the heartbeat
    errors: list[CorruptCheckpointError] = []
    by_batch: dict[str, list[Target]] = collections.defaultdict(list)
    shared: list[tuple[Target, Any]] = []  # (target, its replicated sharding)
    saved_reads = SavedReads(location, doc, fmt, direct, targets)  # what surgery's leaves read

    def fail(paths):
        return lambda e: errors.append(corrupt(paths, location, e))

    opening = {}  # every array's zarr.json read at once (a format with them: version 1)
    for target in targets:
        record = target.record
        if isinstance(record.storage, ArrayStorage) and fmt.array_specs:
            spec = _arrays.leaf_spec(location, target.index, record)
            opening[target.index] = _arrays.open_for_read(spec)
    for target in targets:
        record = target.record
        if record.kind in _layout.NO_DATA_KINDS:
            continue
        if isinstance(record.storage, BatchStorage):
            by_batch[record.storage.batch].append(target)
            continue
        if target.virtual is not None:
            store = saved_reads
        else:
            future = opening.pop(target.index, None)
            store = None if future is None else opened(future, location, [record.path])
        nbytes = record.nbytes
        sharding = sharding_of(target)
        rows = _shared_read_sharding(sharding, record.shape) if request.share_reads else None
        if rows is not None:  # each process reads 1/P; an all-gather replicates it
            shared.append((target, sharding))
            _read_shards(reader, store, target, rows, fail([record.path]), fmt, direct)
        elif sharding is None or sharding.is_fully_replicated or nbytes == 0:
            done = lambda data, target=target: finish(target, data, reader.placer)
            reader.submit(
                read_region(fmt, store, target, direct), nbytes, done, fail([record.path])
            )
        else:
            _read_shards(reader, store, target, sharding, fail([record.path]), fmt, direct)
    for name, members in by_batch.items():
        read_batch(reader, location, doc.batches[name], members, fail, errors, fmt, direct)
    reader.drain(0)
    reader.placer.flush()
    if errors:
        raise deleted_or(location, errors[0])
    return shared  # the all-gathers are read_targets', after the agreement


def _shared_read_sharding(sharding: Any, shape: tuple[int, ...]) -> Any:
    """For a leaf replicated over processes: the sharding splitting its rows, else None."""
    if (
        _distributed.process_count() == 1
        or not isinstance(sharding, jax.sharding.NamedSharding)
        or not sharding.is_fully_replicated
        or not shape
        or shape[0] % sharding.mesh.size
    ):
        return None
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(tuple(sharding.mesh.axis_names))
    )


@functools.lru_cache(maxsize=64)
def _replicate(sharding: Any):  # an all-gather onto ``sharding``
    return jax.jit(lambda x: x, out_shardings=sharding)


def _read_shards(reader: Reader, store, target: Target, sharding, on_error, fmt, direct) -> None:
    """Reads the regions this process's devices need into a global jax.Array."""
    shape = target.record.shape
    by_index: dict[tuple, list] = collections.defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) if isinstance(s, slice) else s for s in index)
        by_index[key].append((device, index))
    pieces: list[jax.Array] = []
    itemsize = target.dtype.itemsize
    if target.virtual is None:
        box = _bounding_box(list(by_index), shape, target.record.storage.chunk_shape)
    else:  # made by surgery: read as one box unless every region is whole saved chunks
        regions = [tuple(_bounds(k, shape)) for k in by_index]
        aligned = len(regions) < 2 or on_chunks(target.virtual, regions)
        box = None if aligned else _bounding_box(list(by_index), shape, shape)
    if box is not None:  # this process's regions tile one box: read it once
        groups = [(box, list(by_index.items()))]
    else:
        groups = [(_bounds(key, shape), [(key, devices)]) for key, devices in by_index.items()]
    remaining = [len(groups)]
    for bounds, members in groups:

        def done(data, bounds=bounds, members=members):
            if data.dtype != target.out_dtype:
                _onto_like.check(target.record.path, data, target.out_dtype, cast=target.cast)
                data = data.astype(target.out_dtype)
            for key, devices in members:
                rel = tuple(
                    slice(lo - blo, hi - blo)
                    for (lo, hi), (blo, _) in zip(_bounds(key, shape), bounds, strict=True)
                )
                pieces.extend(
                    jax.device_put(data[rel], _on(device, sharding)) for device, _ in devices
                )
            remaining[0] -= 1
            if remaining[0] == 0:
                target.result = jax.make_array_from_single_device_arrays(shape, sharding, pieces)

        index = tuple(slice(lo, hi) for lo, hi in bounds)
        nbytes = math.prod(hi - lo for lo, hi in bounds) * itemsize
        reader.submit(read_region(fmt, store, target, direct, index), nbytes, done, on_error)


def _on(device: Any, sharding: Any) -> Any:
    """``device``, in the memory ``sharding`` asks for (or jax refuses to assemble them)."""
    kind = getattr(sharding, "memory_kind", None)
    return device if kind is None else jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def _bounds(key: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(lo or 0, shape[d] if hi is None else hi) for d, (lo, hi) in enumerate(key)]


def _bounding_box(
    keys: list[tuple], shape: tuple[int, ...], chunk: tuple[int, ...]
) -> list[tuple[int, int]] | None:
    """One box around regions that share chunks and nearly fill it, else None."""
    if len(keys) < 2 or not shape:
        return None
    regions = [_bounds(k, shape) for k in keys]
    aligned = all(
        lo % c == 0 and (hi % c == 0 or hi == n)
        for r in regions
        for (lo, hi), c, n in zip(r, chunk, shape, strict=True)
    )
    if aligned:
        return None
    box = [
        (min(r[d][0] for r in regions), max(r[d][1] for r in regions)) for d in range(len(shape))
    ]
    volume = lambda b: int(np.prod([hi - lo for lo, hi in b], dtype=np.int64))
    needed = sum(volume(r) for r in regions)
    return box if volume(box) <= needed * 1.125 else None


def entry_of(target: Target, path: str) -> PlanEntry:
    record = target.record
    if target.virtual is None:
        box = full_box(tuple(record.shape))
        return PlanEntry(path, tuple(record.shape), record.dtype, ((record.path, box),))
    node = target.virtual.node
    pieces, _ = node.pieces(full_box(node.shape))
    sources = tuple((p.record.path, p.box) for p in pieces)
    return PlanEntry(path, tuple(node.shape), node.dtype, sources, target.virtual.how)


def plan_of(
    where: str, targets: list[Target], paths: list[str], kept: list[str], saved: list[str]
) -> RestorePlan:
    """The plan of reading ``targets`` onto like's ``paths`` (``kept``: kept as they are)."""
    entries = tuple(entry_of(t, p) for t, p in zip(targets, paths, strict=True))
    read = {path for e in entries for path, _ in e.sources}
    dropped = tuple(p for p in saved if p not in read)
    return RestorePlan(where, entries, tuple(kept), dropped)


def metadata(path: Any) -> _layout.CheckpointMetadata:
    """``fop.metadata`` of a checkpoint of this library; reads no array data."""
    location = Location.from_path(path)
    _host.wait_for_pending_save(location)
    return _layout.to_public(read_document(location), str(location))


def read_request(
    *,
    region: _distributed.Region,
    partial: bool = False,
    missing: str = "error",
    transform: Any = None,
    surgery: Any = None,
    dry_run: bool = False,
    memory_limit_bytes: int | None = None,
    cast: str = "safe",
    share_replicated_reads: bool | None = None,
    changes: _onto_like.Changes | None = None,
) -> ReadRequest:
    """``fop.restore``'s options checked into a request (``changes``: already checked)."""
    share = share_replicated_reads
    check(RESTORE, {"memory_limit_bytes": memory_limit_bytes, "share_replicated_reads": share})
    dry_run = flag("dry_run", dry_run)
    return ReadRequest(
        memory_limit_bytes=memory_limit_bytes or DEFAULT_READ_LIMIT_BYTES,
        cast=cast,
        share_reads=_distributed.process_count() > 1 if share is None else bool(share),
        changes=changes
        or _onto_like.changes(
            partial=partial, missing=missing, transform=transform, surgery=surgery
        ),
        dry_run=dry_run,
        region=region,
    )


def restore_with(path: Any, like: Any, request: ReadRequest) -> Any:
    location = Location.from_path(path)
    _host.wait_for_pending_save(location)
    with _tree.paused_gc():
        like = _onto_like.concrete(like)  # shardings on an AbstractMesh: onto set_mesh's mesh
        if not request.own_copy and request.region.spans:  # a collective read
            agree_on_read(location, like, request)  # the same on every process, before a byte
        opts = request.changes
        if location.is_local and not opts.partial and opts.transform is None and not opts.surgery:
            # every batch is read whole: the disk starts on it while the metadata is parsed
            _chunk_files.prefetch_batches(location.path, _chunks.THREADS)
        doc = read_document(location)
        location.check_no_links(read=_formats.checkpoint_names)  # tensorstore follows links
        saved = [rec.path for rec in doc.leaves if rec.kind not in _onto_like.NO_DATA]
        if like is None:
            return _as_saved(location, doc, request, saved)
        return _read_onto_like(location, doc, like, request, saved)


def _dropped_or_same(opts: _onto_like.Changes, path: str) -> bool:
    """With ``like=None`` a transform may only drop leaves (False), not rename them."""
    new = opts.rename(path)
    if new is not None and new != path:
        raise TransformError(
            f"transform renames the saved leaf {path!r} to {new!r}, which needs like (the "
            f"tree to place it in); with like=None a transform may only drop leaves (None)"
        )
    return new is not None


def _as_saved(location: Location, doc, request: ReadRequest, saved: list[str]) -> Any:
    """``like=None``: the saved leaves (a transform may drop some) on the host, as saved."""
    opts = request.changes
    if opts.surgery:
        raise TransformError(f"surgery= needs like, found like=None (restore of {location})")
    leaves = list(enumerate(doc.leaves))
    if opts.transform is not None:
        leaves = [(i, rec) for i, rec in leaves if _dropped_or_same(opts, rec.path)]
        if all(rec.kind in _onto_like.NO_DATA for _, rec in leaves):
            _onto_like.check_matched(saved, None, [], opts, str(location))
    targets = [make_target(i, rec, None, cast=request.cast) for i, rec in leaves]
    if request.dry_run:
        paths = [t.record.path for t in targets]
        return plan_of(str(location), targets, paths, [], saved)
    read_targets(location, doc, targets, request)
    return _tree.rebuild([(list(t.record.keys), t.result) for t in targets])


def _read_onto_like(
    location: Location, doc, like: Any, request: ReadRequest, saved: list[str]
) -> Any:
    opts = request.changes
    flat, treedef = _tree.flatten(like)
    records = {rec.path: (i, rec) for i, rec in enumerate(doc.leaves)}
    records = _onto_like.rename_records(records, opts, str(location))
    made, problems = {}, []
    if opts.surgery:
        ops = opts.surgery
        if opts.surgery_mirrored:  # an optimizer state: the ops at each mirror of params
            ops = _surgery.mirrored(ops, records)
        records, made, problems = _surgery.apply(records, ops)
    add_missing_empties(flat, records)
    plan = _onto_like.match(
        flat,
        records,
        opts,
        where=str(location),
        make=_maker(made, request.cast),
        problems=problems,  # the operations' own, listed first
        empty_kinds=_layout.EMPTY_KINDS,
        saved=saved,
        cast=request.cast,
    )
    targets = [t for t in plan if t is not _onto_like.KEEP]
    paired = list(zip(plan, flat, strict=True))
    if request.dry_run:
        paths = [p for t, (p, _, _) in paired if t is not _onto_like.KEEP]
        kept = [p for t, (p, _, _) in paired if t is _onto_like.KEEP]
        return plan_of(str(location), targets, paths, kept, saved)
    read_targets(location, doc, targets, request)
    results = [leaf if t is _onto_like.KEEP else t.result for t, (_, _, leaf) in paired]
    return jax.tree_util.tree_unflatten(treedef, results)


def _maker(made: dict[str, Any], cast: str):
    def make(i, rec, leaf):
        found = made.get(rec.path)
        if found is None or found.record is not rec:
            return make_target(i, rec, leaf, cast=cast)
        try:
            target = make_target(i, rec, leaf, cast=cast)
        except StructureError as e:
            raise StructureError(f"{e} (as surgery made it: {found.how})") from None
        target.virtual = found
        return target

    return make


# -- the leaves layout surgery made --------------------------------------------------------


def _box(region: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A region (slices, None: all) as ``((lo, hi), ...)``."""
    if region is None:
        return tuple((0, n) for n in shape)
    out = []
    for s, n in zip(region, shape, strict=True):
        lo, hi, _ = s.indices(n) if isinstance(s, slice) else (s, s + 1, 1)
        out.append((lo, hi))
    return tuple(out)


class VirtualRead:
    """The read of ``region`` of a made leaf: pieces read now, assembled on :meth:`result`."""

    def __init__(self, made: Any, region: Any, saved: SavedReads):
        pieces, self.assemble = made.node.pieces(_box(region, made.node.shape))
        self.reads = [saved.read(p) for p in pieces]

    def result(self) -> np.ndarray:
        return self.assemble([r.result() for r in self.reads])


class _Cut:
    """A small leaf out of one read of its batch from ``start`` (``span()``), cut to ``box``."""

    def __init__(self, span, start: int, record, box):
        self.span, self.start, self.record, self.box = span, start, record, box

    def result(self) -> np.ndarray:
        off, size = self.record.storage.offset - self.start, self.record.storage.size
        data = self.span()[off : off + size]
        if self.record.storage.packed:  # a sub-byte leaf's packed bytes
            data = _subbyte.unpack_flat(data, self.record)
        data = data.reshape(self.record.shape)
        return data[tuple(slice(lo, hi) for lo, hi in self.box)]


class SavedReads:
    """Region reads of saved leaves; a store opened once, a batch's span read once."""

    def __init__(self, location, doc, fmt, direct, targets: list[Target]):
        self.location, self.doc, self.fmt, self.direct = location, doc, fmt, direct
        self.stores: dict[Any, Any] = {}
        self.spans: dict[str, tuple[int, int]] = {}
        for t in sources(targets):
            storage = t.record.storage
            if isinstance(storage, ArrayStorage):
                continue
            lo, hi = self.spans.get(storage.batch, (storage.offset, storage.offset))
            end = storage.offset + storage.size
            self.spans[storage.batch] = (min(lo, storage.offset), max(hi, end))

    def read(self, piece: Piece):
        record = piece.record
        target = make_target(piece.index, record, None, cast="safe")
        if isinstance(record.storage, ArrayStorage):
            key = ("leaf", piece.index)
            if key not in self.stores:
                self.stores[key] = self.fmt.array_store(self.location, target, [record.path])
            region = tuple(slice(lo, hi) for lo, hi in piece.box)
            return read_region(self.fmt, self.stores[key], target, self.direct, region)
        batch = self.doc.batches[record.storage.batch]
        key = ("batch", batch.name)
        if key not in self.stores:
            self.stores[key] = self.fmt.batch_store(
                self.location, batch, self.direct, [record.path]
            )
        lo, hi = self.spans[batch.name]
        if ("span", batch.name) not in self.stores:  # waited for once, for every leaf cut
            read = read_slice(self.stores[key], self.direct, batch, lo, hi - lo)
            self.stores["span", batch.name] = functools.cache(read.result)
        return _Cut(self.stores["span", batch.name], lo, record, piece.box)


def on_chunks(made: Any, boxes: list[tuple[tuple[int, int], ...]]) -> bool:
    """Whether every saved region ``boxes`` need falls on whole chunks (each box read alone)."""
    for box in boxes:
        pieces, _ = made.node.pieces(box)
        for p in pieces:
            storage = p.record.storage
            if not isinstance(storage, ArrayStorage):
                continue  # a small leaf: its batch span is read once whatever the boxes
            for (lo, hi), c, n in zip(p.box, storage.chunk_shape, p.record.shape, strict=True):
                if lo % c or (hi % c and hi != n):
                    return False
    return True


def sources(targets: list[Target]) -> list[Target]:
    """The saved leaves the made leaves among ``targets`` read (for the claims check)."""
    out: dict[int, Target] = {}
    for t in targets:
        if t.virtual is None:
            continue
        node = t.virtual.node
        pieces, _ = node.pieces(tuple((0, n) for n in node.shape))
        for p in pieces:
            out.setdefault(p.index, make_target(p.index, p.record, None, cast="safe"))
    return list(out.values())
