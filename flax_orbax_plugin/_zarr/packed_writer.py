"""Writing format version 2: this process's chunks packed into a few large data files.

:class:`PackedWriter` is a :class:`~chunk_writer.ChunkWriter` whose chunk "files" are
segments of data files ``data/<process>-<n>.bin``: each chunk gets the next offset of
the current data file (a new file once ``target_bytes`` would be passed) and is written
there with one ``pwritev`` on a local disk; on an object store the segments are
gathered in memory and each data file is written as one object when it is full (or
at :meth:`close`). :meth:`index` is the ``data/<process>.json`` that lists them
(``packed_index``). Files are created with ``O_EXCL | O_NOFOLLOW`` in the save's fresh
staging directory.

Threading: as ``ChunkWriter``: one per save, driven by the save's background thread;
segments are written by the writer's threads (offsets handed out under a lock), which
may run at a lower priority (``_base.env``) only on a local disk; compressed
chunks are encoded (tensorstore's codecs, which start threads of their own) on a pool
of their own at the process's priority.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

import numpy as np

from .._storage import json_docs as _docs
from .._storage.location import Location, check_name
from . import chunk_writer as _chunk_writer
from . import chunks as _chunks
from . import packed_codec as _codec
from . import packed_index as _index

LOCAL_DATA_FILE_BYTES = 1 << 30  # a data file on a local or shared filesystem
OBJECT_DATA_FILE_BYTES = 256 << 20  # an object (written whole from memory)
MAX_LANES = 4  # object stores: data files filled (and uploaded) at once
LANE_BYTES = 64 << 20  # object stores: one more lane per this many bytes to write


# A segment from memory that starts past a page boundary (a zero-copy view of a jax
# buffer) is written directly only from this size: its file offset then skips up to
# a page to match the address (at most 0.4% more file).
_UNALIGNED_DIRECT_MIN = 1 << 20


def default_data_file_bytes(location: Location) -> int:
    return LOCAL_DATA_FILE_BYTES if location.is_local else OBJECT_DATA_FILE_BYTES


class PackedWriter(_chunk_writer.ChunkWriter):
    """Writes whole chunks of arrays and batches of one process into data files under
    ``location`` (its ``data/``); ``target_bytes``: a data file's size it does not pass
    unless one chunk is larger. On an object store, up to :data:`MAX_LANES` data files
    are filled side by side (one per :data:`LANE_BYTES` of ``total_bytes``, what this
    process writes), so that their uploads overlap: a single PUT is one stream.
    ``gathered_bytes`` (a host-memory budget's share): on an object store, the files
    being filled hold at most this many bytes in all (smaller files, at least one chunk
    each); None: no bound."""

    def __init__(
        self,
        location: Location,
        process: int,
        target_bytes: int | None = None,
        total_bytes: int = 0,
        *,
        gathered_bytes: int | None = None,
    ):
        super().__init__(location.path if location.is_local else "", local_only=location.is_local)
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None  # see encoded
        self._location = location
        self._process = int(process)
        self._target = int(target_bytes or default_data_file_bytes(location))
        if self._target < 1:
            raise ValueError(f"data_file_bytes: expected a positive size, found {self._target}")
        self._lock = threading.Lock()
        self._files: dict[str, int] = {}  # name -> bytes handed out
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int] = {}  # local: the same files opened O_DIRECT
        self._current: str | None = None  # local: the file being filled
        lanes = 1 if location.is_local else min(MAX_LANES, max(1, -(-total_bytes // LANE_BYTES)))
        if gathered_bytes is not None and not location.is_local:
            self._target = max(1, min(self._target, gathered_bytes // lanes))
        self._lanes: list[list] = [[None, []] for _ in range(lanes)]  # [file, its pieces]
        self._lane_of: dict[str, int] = {}  # array (d/<i>, b/<batch>) -> its lane
        self._chunks: dict[str, _index.Segment] = {}

    def adopt(self, files: dict[str, int], chunks: dict[str, _index.Segment]) -> None:
        """Lists data files already in place (an incremental step's files taken from the
        previous step, named by this process's first numbers: name -> size) and their
        segments; call before any write. New chunks go to new files after them."""
        with self._lock:
            if self._files:
                raise ValueError("adopt() comes before the first chunk")
            self._files.update(files)
            self._chunks.update(chunks)

    def encoded(self, sub: str, spec: dict[str, Any], writes: list) -> concurrent.futures.Future:
        """Starts writing the chunks of ``writes`` (regions of whole chunks of the array
        ``sub``, and their values) compressed as ``spec`` (built under
        ``packed_codec.MEMORY``) says: one segment per chunk, its stored bytes."""
        if self._encoder is None:  # the process's priority: the codecs start threads
            self._encoder = concurrent.futures.ThreadPoolExecutor(
                _chunks.THREADS, thread_name_prefix="fop-encode"
            )
        return self._encoder.submit(self._write_encoded, sub, spec, writes)

    def _write_encoded(self, sub: str, spec: dict[str, Any], writes: list) -> None:
        for key, value in _codec.encode(spec, writes):
            raw = np.frombuffer(value, np.uint8)
            if raw.size <= _chunks.CRC_BYTES:
                raise ValueError(f"{sub}/{key}: an encoded chunk of {raw.size} bytes")
            self._write_file(f"{sub}/{key}", [raw[: -_chunks.CRC_BYTES], raw[-_chunks.CRC_BYTES :]])

    def _write_file(self, name: str, pieces: list[np.ndarray]) -> None:
        """Called by the writer's threads for one chunk (``name``: its version-1 key)."""
        check_name(name)
        pieces = [p for p in pieces if p.size]
        length = sum(p.size for p in pieces)
        crc = int.from_bytes(pieces[-1].tobytes(), "little")
        if self._location.is_local:
            first = pieces[0]
            skip, head = _chunk_writer.direct_span(first, 1 << 16) if self._direct else (0, 0)
            if skip and head < _UNALIGNED_DIRECT_MIN:  # the file's padding would cost more
                skip, head = 0, 0
            phase = None if not head else first.ctypes.data % _chunk_writer.DIRECT_ALIGN
            file, offset, fd = self._allocate_local(length, phase=phase)
            views = [memoryview(p) for p in pieces]
            at = offset
            if head:  # the bytes before the first page boundary (buffered), then pages
                raw = memoryview(first.reshape(-1).view(np.uint8))
                while at < offset + skip:
                    at += os.pwrite(fd, raw[at - offset : skip], at)
                _chunks.advance(views, skip)
                if self._write_direct_at(file, raw[skip : skip + head], at):
                    at += head
                    _chunks.advance(views, head)
            while views:
                done = os.pwritev(fd, views[: _chunks.IOV_MAX], at)
                at += done
                _chunks.advance(views, done)
            if _chunk_writer._sync_file_range is not None:  # start writeback; no wait
                _chunk_writer._sync_file_range(
                    fd, offset, length, _chunk_writer._SYNC_FILE_RANGE_WRITE
                )
        else:
            file, offset, full = self._append(_index.array_prefix(name), pieces, length)
            if full is not None:
                self._upload(*full)
        with self._lock:
            self._chunks[name] = _index.Segment(file, offset, length, crc)

    def _next_file(self) -> str:
        """Under the lock: starts data file number len(files)."""
        name = _index.data_file_name(self._process, len(self._files))
        self._files[name] = 0
        self._current = name
        return name

    def _allocate_local(self, length: int, phase: int | None = None) -> tuple[str, int, int]:
        """(file, offset, its fd) for a segment of ``length`` bytes; ``phase``: at an
        offset congruent to it modulo a page (the source's address; the bytes skipped
        mean nothing, FORMAT.md), for a direct write of its whole pages."""
        with self._lock:
            name = self._current
            if name is None or (self._files[name] and self._files[name] + length > self._target):
                name = self._next_file()
                directory = os.path.join(self._location.path, _index.DATA_DIR)
                os.makedirs(directory, exist_ok=True)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                self._fds[name] = os.open(os.path.join(directory, name), flags, 0o644)
            offset = self._files[name]
            if phase is not None:
                offset += (phase - offset) % _chunk_writer.DIRECT_ALIGN
            self._files[name] = offset + length
            return name, offset, self._fds[name]

    def _write_direct_at(self, file: str, view: memoryview, offset: int) -> bool:
        """Writes ``view`` (whole pages, page-aligned) at ``offset`` (page-aligned) of
        data file ``file`` with ``O_DIRECT``, through a second descriptor of the file
        (the shared one stays buffered for the other threads' tails); False, having
        written nothing that counts, where the filesystem refuses it (then off)."""
        try:
            with self._lock:
                fd = self._direct_fds.get(file)
                if fd is None:
                    path = os.path.join(self._location.path, _index.DATA_DIR, file)
                    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | _chunk_writer.O_DIRECT
                    fd = self._direct_fds[file] = os.open(path, flags)
            done, head = 0, len(view)
            while done < head:
                done += os.pwrite(fd, view[done:], offset + done)
            return True
        except OSError:
            self._direct = False
            return False

    def _append(self, array: str, pieces, length: int):
        """Object stores: adds the segment's pieces (views of the snapshot, kept until
        the file is written: joined once, no other copy) to the current file; returns
        (file, offset, the finished file's (name, pieces) to upload, or None)."""
        full = None
        with self._lock:
            # an array's chunks go to one lane: side by side, read back by few GETs
            number = self._lane_of.setdefault(array, len(self._lane_of) % len(self._lanes))
            lane = self._lanes[number]
            name = lane[0]
            if name is None or (self._files[name] and self._files[name] + length > self._target):
                if name is not None:
                    full = (name, lane[1])
                lane[0], lane[1] = self._next_file(), []
                name = lane[0]
            offset = self._files[name]
            lane[1].extend(pieces)
            self._files[name] = offset + length
        return name, offset, full

    def _upload(self, name: str, pieces: list[np.ndarray]) -> None:
        data = b"".join(memoryview(p) for p in pieces)
        pieces.clear()
        self._location.write_bytes(f"{_index.DATA_DIR}/{name}", data)

    def close(self) -> None:
        """Waits for every chunk, writes the last object (object stores) and closes the
        data files (local; made durable by the save's sync)."""
        try:
            if self._encoder is not None:
                self._encoder.shutdown(wait=True)
            super().close()
            last = [(name, pieces) for name, pieces in self._lanes if name is not None]
            self._lanes = []
            if last:  # the lanes' last files, uploaded side by side
                with concurrent.futures.ThreadPoolExecutor(len(last)) as pool:
                    for future in [pool.submit(self._upload, *item) for item in last]:
                        future.result()
        finally:
            for fd in [*self._fds.values(), *self._direct_fds.values()]:
                os.close(fd)
            self._fds, self._direct_fds = {}, {}

    def index(self, dtypes: dict[str, str] | None = None) -> _index.DataIndex:
        """The index of everything written (call after :meth:`close`); ``dtypes``: the
        stored dtype name of each array (``d/<i>``, ``b/<batch>``), recorded for those
        with chunks here."""
        chunks = dict(self._chunks)
        held = {_index.array_prefix(key) for key in chunks}
        arrays = {k: v for k, v in (dtypes or {}).items() if k in held}
        return _index.DataIndex(self._process, dict(self._files), chunks, arrays)

    def write_index(self, dtypes: dict[str, str] | None = None) -> tuple[str, bytes]:
        """Writes ``data/<process>.json`` (not yet durable); returns (its name, bytes)."""
        name = _index.index_name(self._process)
        raw = _docs.encode(self.index(dtypes).to_json(), name, _docs.DATA_INDEX)
        self._location.write_bytes(name, raw, durable=False)
        return name, raw
