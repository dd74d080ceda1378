"""What a checkpoint's metadata claims, checked against its chunk files before
anything sized by a claim is allocated (local disks; see :func:`check_claims`)."""

from __future__ import annotations

import collections

from .._errors import CorruptCheckpointError
from .._format import layout as _layout
from .._format.layout import (
    METADATA_FILE,
    ArrayStorage,
    BatchStorage,
    CheckpointDocument,
    array_dir,
    batch_dir,
)
from .._format.layout.checked import show
from .._storage.location import Location
from .._zarr import chunk_files as _chunk_files
from .._zarr import subbyte as _subbyte
from .._zarr.chunks import CHUNK_DIR


def check_claims(
    location: Location, doc: CheckpointDocument, targets: list, *, own_copy: bool
) -> None:
    """Checks that the chunk files of every array and batch that ``targets`` read hold
    at least the bytes their metadata claims, before anything sized by a claim is
    allocated (a resealed, checksum-valid ``_METADATA.json`` may claim any shape):
    a CorruptCheckpointError naming the file, the field and what is on disk otherwise.
    Local disks only (object stores list no sizes: a read there is bounded by the
    ``zarr.json`` agreement and tensorstore's own per-chunk checks). One ``stat`` per
    existing chunk file; nothing per claimed element or chunk.

    ``own_copy``: a host's own copy of a manager step (each host its own directory)
    holds the chunks of its own regions only: an array read onto a ``like`` with a
    sharding (sized by the caller, each process reading its own regions) is not checked
    against the whole claim."""
    if not location.is_local:
        return
    where = f"{location}/{METADATA_FILE}"
    batches: dict[str, list[str]] = collections.defaultdict(list)
    for target in targets:
        record = target.record
        storage = record.storage
        if isinstance(storage, BatchStorage):
            batches[storage.batch].append(record.path)
        if not isinstance(storage, ArrayStorage):
            continue
        if own_copy and getattr(target.like, "sharding", None) is not None:
            continue
        record = _subbyte.stored(record)  # a packed leaf: its bytes as stored
        storage = record.storage
        itemsize = _layout.dtype_from_name(record.dtype, path=record.path).itemsize
        needed = _chunk_files.array_claim(
            record.shape, storage.chunk_shape, itemsize, compressed=storage.codec is not None
        )
        field = f"leaves[{target.index}] ({record.path!r}).shape"
        sub = array_dir(target.index)
        _check_claim(location, sub, needed, where, field, record.shape)
    for name, paths in sorted(batches.items()):
        batch = doc.batches[name]
        itemsize = _layout.dtype_from_name(batch.dtype).itemsize
        needed = _chunk_files.batch_claim(
            batch.size,
            int(batch.chunk),
            batch.inner,
            itemsize,
            compressed=batch.codec is not None,
        )
        shown = ", ".join(repr(p) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")
        field = f"batches[{name!r}].size (holding leaves {shown})"
        _check_claim(location, batch_dir(name), needed, where, field, batch.size)


def _check_claim(location, sub: str, needed, where: str, field: str, claim) -> None:
    files, nbytes = needed
    if files == 0:
        return
    found_files, found_bytes = _chunk_files.stored_files(location.path, sub)
    if found_files < files or found_bytes < nbytes:
        raise CorruptCheckpointError(
            f"{where}: field {field}: {show(claim)} needs {files} chunk files of "
            f"{nbytes} bytes in all under {location}/{sub}/{CHUNK_DIR}, "
            f"found {found_files} files of "
            f"{found_bytes} bytes (stored data is damaged or missing, or the metadata "
            f"claims more than was stored)"
        )


def check_packed_claims(location: Location, doc: CheckpointDocument, targets: list, packed) -> None:
    """Format version 2: the data indexes list at least the chunks and bytes that every
    array and batch ``targets`` read claims (each listed segment lies inside its data
    file, checked when the reader opened them on a local disk), before anything sized
    by a claim is allocated."""
    where = f"{location}/{METADATA_FILE}"
    seen: set[str] = set()
    for target in targets:
        record = target.record
        storage = record.storage
        if isinstance(storage, BatchStorage) and storage.batch not in seen:
            seen.add(storage.batch)
            batch = doc.batches[storage.batch]
            itemsize = _layout.dtype_from_name(batch.dtype).itemsize
            needed = _chunk_files.batch_claim(
                batch.size,
                int(batch.chunk),
                batch.inner,
                itemsize,
                compressed=batch.codec is not None,
            )
            field = f"batches[{storage.batch!r}].size"
            sub = batch_dir(storage.batch)
            _check_dtype(packed, sub, batch.dtype, where, f"batches[{storage.batch!r}].dtype")
            _check_listed(packed, sub, needed, where, field, batch.size)
        if isinstance(storage, ArrayStorage):
            record = _subbyte.stored(record)  # a packed leaf: its bytes as stored
            storage = record.storage
            itemsize = _layout.dtype_from_name(record.dtype, path=record.path).itemsize
            needed = _chunk_files.array_claim(
                record.shape, storage.chunk_shape, itemsize, compressed=storage.codec is not None
            )
            field = f"leaves[{target.index}] ({record.path!r})"
            sub = array_dir(target.index)
            _check_dtype(packed, sub, record.dtype, where, f"{field}.dtype")
            _check_listed(packed, sub, needed, where, f"{field}.shape", record.shape)


def _check_dtype(packed, sub: str, claim: str, where: str, field: str) -> None:
    """The dtype the metadata claims is the one the data index says the bytes were
    written as (an index written before dtypes were recorded names none)."""
    found = packed.dtypes.get(sub)
    if found is not None and found != claim:
        raise CorruptCheckpointError(
            f"{where}: field {field}: the metadata claims {claim!r}, the data index "
            f"records the bytes under {sub} as {found!r} (the metadata or the index is "
            f"damaged: restoring would reinterpret the bytes)"
        )


def _check_listed(packed, sub: str, needed, where: str, field: str, claim) -> None:
    files, nbytes = needed
    found, found_bytes = packed.claimed(sub)
    if files and (found < files or found_bytes < nbytes):
        raise CorruptCheckpointError(
            f"{where}: field {field}: {show(claim)} needs {files} chunks of {nbytes} bytes "
            f"in all under {sub}, the data indexes list {found} of {found_bytes} bytes "
            f"(stored data is damaged or missing, or the metadata claims more than was stored)"
        )
