"""The chunk reader of a checkpoint (format version 1 or 2) and a read of a slice of a
batch through it; used by restore (``read_data``) and ``verify``. Calling thread only.
"""

from __future__ import annotations

from .._errors import CorruptCheckpointError
from .._format import layout as _layout
from .._format.layout import BatchRecord, CheckpointDocument, batch_dir
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunk_files as _chunk_files
from .._zarr import packed_reader as _packed_reader
from .claims import check_claims, check_packed_claims


def open_direct(location: Location, doc: CheckpointDocument, targets: list, *, own_copy: bool):
    """The chunk reader of a checkpoint, its claims checked first: a PackedReader for
    format version 2 (every array and batch read through it), the local ChunkReader
    for version 1 where it applies, else None (tensorstore reads). ``own_copy``: a
    host's own copy of a manager step (see ``claims.check_claims``)."""
    if doc.format_version == 2:
        try:
            packed = _packed_reader.open_packed(location, doc.process_count)
        except ValueError as e:
            env = _arrays.environmental(e)
            if env is e:
                raise
            if env is not None:
                raise env from e
            raise CorruptCheckpointError(f"{location}: {e}") from None
        try:
            check_packed_claims(location, doc, targets, packed)
        except BaseException:
            packed.close()
            raise
        return packed
    check_claims(location, doc, targets, own_copy=own_copy)
    return _chunk_files.ChunkReader(location.path) if _chunk_files.usable(location) else None


def read_slice(direct: _packed_reader.PackedReader, batch: BatchRecord, off: int, size: int):
    """A read of elements ``[off, off + size)`` of a version-2 batch: the batch files
    holding them, then the slice."""
    chunk = int(batch.chunk)
    files = range(off // chunk, -(-(off + size) // chunk)) if size else range(0)
    dtype = _layout.dtype_from_name(batch.dtype)
    sub, inner = batch_dir(batch.name), _arrays.batch_inner(batch)
    read = direct.read_batch(sub, batch.size, chunk, inner, dtype, files)
    first = files.start * chunk if files else 0
    read.out = read.out[off - first : off - first + size]
    return read
