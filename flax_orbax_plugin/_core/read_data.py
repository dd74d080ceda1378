"""Reading the stored data of a restore's targets: arrays, shards, batches.

:func:`read_targets` opens the checkpoint's format (``formats``, from its metadata:
the claims checked first), then issues every read in order through it: whole chunks
of plain local arrays straight from their files, anything else through tensorstore
or the data files' reader, keeping at most the request's bytes of reads in flight.
Damage is reported per leaf (CorruptCheckpointError), a checkpoint deleted while read
as StepDeletedError, and environmental failures (EMFILE, EIO, timeouts) as what they
are.
Threading: reads are issued from the calling thread to tensorstore's own pool and
the chunk reader's threads; callbacks run on the calling thread.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import liveness as _liveness
from .._errors import CheckpointNotFoundError, CorruptCheckpointError
from .._format import host_copy as _host_copy
from .._format import layout as _layout
from .._format.layout import ArrayStorage, BatchStorage, CheckpointDocument
from .._like import casting as _casting
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import subbyte as _subbyte
from . import formats as _formats
from . import surgery_reads as _surgery_reads
from .batch_reads import read_batch
from .reads import Reader, corrupt, deleted_or, opened
from .requests import ReadRequest
from .targets import Target, finish, sharding_of


def read_targets(location: Location, doc: CheckpointDocument, targets: list, request: ReadRequest):
    """Reads every target's data into ``target.result``, as ``request`` says (reads in
    flight, shared reads, a host's own copy).

    When the processes read together (a target placed on devices of several processes,
    or a leaf read shared, ``request.share_reads``: each process reads its rows, then an
    all-gather) this is collective: the processes agree on the outcome of their reads
    before any all-gather, so a read that fails on one process (damage in a region only
    it reads, an I/O error) raises on every process, naming it, rather than the others
    going on with a state that process lacks, or waiting in the all-gather. Host arrays
    alone are no collective (one process may read alone); the manager's restore also
    agrees per step (``Restorer._agreed``)."""
    # from the targets and the request alone: the same on every process
    collective = _collective(targets, request.share_reads)
    error = None
    shared: list = []
    try:
        shared = _read_targets_inner(location, doc, targets, request)
    except (CorruptCheckpointError, CheckpointNotFoundError) as e:
        # damage, or (version 2: its indexes are read now) the checkpoint gone meanwhile
        error = deleted_or(location, e)
    except Exception as e:  # noqa: BLE001  (re-raised below, after the agreement)
        error = e
    if collective:
        where = f"restore of {location}"
        _distributed.agree("restore-read", error, region=request.region, what=where)
    elif error is not None:
        raise error
    for target, sharding in shared:  # collective, in the same order on every process
        target.result = _replicate(sharding)(target.result)


def _collective(targets: list, share_reads: bool) -> bool:
    """Whether reading ``targets`` is a read by several processes together (see
    read_targets): a leaf read shared (then all-gathered), or placed on devices of
    other processes. Not for each host's own directory (``share_reads`` off), where
    every process reads alone and the manager agrees per step."""
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
    # the claims of the saved leaves surgery's leaves are made of are checked too
    made = [t for t in targets if t.virtual is not None]  # surgery's leaves
    checked = targets + (_surgery_reads.sources(made) if made else [])
    copy = None if request.own_copy else _host_copy.of_item(location)  # read alone
    partial = [] if copy is None else copy.partial(location.name, [t.record for t in checked])
    if partial:  # one host's copy (a directory per host) never passes for the whole
        raise copy.refusal(location, partial)
    direct = fmt.open(location, doc, checked, own_copy=request.own_copy)
    try:
        with _liveness.ACTIVITIES.doing(f"reading {location}", moving=True) as progress:
            return _read_targets_with(location, doc, targets, request, fmt, direct, progress)
    finally:
        if direct is not None:
            direct.close()


def read_region(fmt, store, target: Target, direct, region=None):
    """A read of ``region`` (global; None: all) of a stored array in format ``fmt``
    through ``direct`` (its reader): straight from its chunk files where they are plain
    (local, uncompressed) and the region is whole chunks, else through tensorstore or
    the data files' reader; a packed (sub-byte) leaf's stored bytes, unpacked; a leaf
    surgery made, as the regions of the saved leaves it covers (``store``: their
    ``SavedReads``)."""
    record = target.record
    if target.virtual is not None:  # made by surgery: ``store`` reads the saved leaves
        return _surgery_reads.VirtualRead(target.virtual, region, store)
    if _subbyte.is_packed(record):
        inner, width, skip = _subbyte.stored_region(record, region)
        read = fmt.read_stored(store, target.index, _subbyte.stored(record), direct, inner)
        return _subbyte.Unpacked(read, record, width, skip)
    return fmt.read_stored(store, target.index, record, direct, region)


def _read_targets_with(location, doc, targets, request: ReadRequest, fmt, direct, progress):
    reader = Reader(request.memory_limit_bytes, progress)  # progress: read by the heartbeat
    errors: list[CorruptCheckpointError] = []
    by_batch: dict[str, list[Target]] = collections.defaultdict(list)
    shared: list[tuple[Target, Any]] = []  # (target, its replicated sharding)
    saved_reads = None  # the saved leaves that surgery's leaves read, if there are any
    if any(t.virtual is not None for t in targets):
        saved_reads = _surgery_reads.SavedReads(location, doc, fmt, direct, read_region, targets)

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

            def done(data, target=target):
                finish(target, data, reader.placer)

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
    """For a leaf replicated over several processes: the sharding that splits its rows
    over every device (each process then reads only its devices' rows), or None where
    that does not apply (one process, not replicated, rows not divisible)."""
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
def _replicate(sharding: Any):
    """An all-gather onto ``sharding`` (jax's collectives: the interconnect, or gloo on
    CPU), as one jitted identity."""
    return jax.jit(lambda x: x, out_shardings=sharding)


def _read_shards(reader: Reader, store, target: Target, sharding, on_error, fmt, direct) -> None:
    """Reads only the regions this process's devices need; assembles a global jax.Array."""
    shape = target.record.shape
    by_index: dict[tuple, list] = collections.defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) if isinstance(s, slice) else s for s in index)
        by_index[key].append((device, index))
    pieces: list[jax.Array] = []
    remaining = [len(by_index)]
    itemsize = target.dtype.itemsize
    if target.virtual is None:
        box = _bounding_box(list(by_index), shape, target.record.storage.chunk_shape)
    else:  # made by surgery: read as one box unless every region is whole saved chunks
        regions = [tuple(_bounds(k, shape)) for k in by_index]
        aligned = len(regions) < 2 or _surgery_reads.on_chunks(target.virtual, regions)
        box = None if aligned else _bounding_box(list(by_index), shape, shape)
    if box is not None:  # this process's regions tile one box: read it once
        box_index = tuple(slice(lo, hi) for lo, hi in box)

        def done_box(data):
            if data.dtype != target.out_dtype:
                _casting.check(target.record.path, data, target.out_dtype, cast=target.cast)
                data = data.astype(target.out_dtype)
            for key, devices in by_index.items():
                rel = tuple(
                    slice(lo - blo, hi - blo)
                    for (lo, hi), (blo, _) in zip(_bounds(key, shape), box, strict=True)
                )
                pieces.extend(
                    jax.device_put(data[rel], _on(device, sharding)) for device, _ in devices
                )
            target.result = jax.make_array_from_single_device_arrays(shape, sharding, pieces)

        nbytes = math.prod(hi - lo for lo, hi in box) * itemsize
        reader.submit(
            read_region(fmt, store, target, direct, box_index), nbytes, done_box, on_error
        )
        return

    for key, devices in by_index.items():
        index = devices[0][1]
        nbytes = math.prod(hi - lo for lo, hi in _bounds(key, shape)) * itemsize

        def done(data, devices=devices):
            if data.dtype != target.out_dtype:
                _casting.check(target.record.path, data, target.out_dtype, cast=target.cast)
                data = data.astype(target.out_dtype)
            pieces.extend(jax.device_put(data, _on(device, sharding)) for device, _ in devices)
            remaining[0] -= 1
            if remaining[0] == 0:
                target.result = jax.make_array_from_single_device_arrays(shape, sharding, pieces)

        reader.submit(read_region(fmt, store, target, direct, index), nbytes, done, on_error)


def _on(device: Any, sharding: Any) -> Any:
    """Where one shard goes: ``device``, in the memory ``sharding`` asks for (a
    ``pinned_host`` target's pieces must be there too, or jax refuses to assemble them)."""
    kind = getattr(sharding, "memory_kind", None)
    return device if kind is None else jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


def _bounds(key: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(lo or 0, shape[d] if hi is None else hi) for d, (lo, hi) in enumerate(key)]


def _bounding_box(
    keys: list[tuple], shape: tuple[int, ...], chunk: tuple[int, ...]
) -> list[tuple[int, int]] | None:
    """The box around several regions when a stored chunk straddles two of them and they
    (nearly) fill the box, so one read serves them all and no chunk is read twice.
    Regions that fall on chunk boundaries are read separately, each straight into its
    own buffer (no extra copy)."""
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
