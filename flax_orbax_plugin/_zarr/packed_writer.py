"""Writing chunks straight from host memory: version 1's file per chunk and version 2's
data files. One writer per save, driven by the save's background thread only; its
futures are completed by the writer's own threads.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._zarr.packed_writer``.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import fcntl
import functools
import os
import sys
import threading
from typing import Any

import numpy as np

from .._base import env as _env
from .._base import host as _host
from .._storage import local_files as _local_files
from .._storage.location import Location, check_name
from . import arrays as _arrays
from . import chunks as _chunks

_SYNC_FILE_RANGE_WRITE = 2
DIRECT_ALIGN = 4096  # address, length and file offset of an O_DIRECT write
O_DIRECT = getattr(os, "O_DIRECT", 0)


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def direct_span(first: np.ndarray, minimum: int = DIRECT_ALIGN) -> tuple[int, int]:
    """(skip, length) of the whole pages of ``first`` an ``O_DIRECT`` write can take (0, 0:
    none, or fewer than ``minimum`` bytes)."""
    if not first.flags.c_contiguous:
        return 0, 0
    skip = -first.ctypes.data % DIRECT_ALIGN
    body = first.nbytes - skip
    length = body - body % DIRECT_ALIGN
    return (skip, length) if length >= max(minimum, 1) else (0, 0)


class ChunkWriter:
    """Writes whole zarr3 chunks of arrays from host memory under the local ``root``."""

    def __init__(self, root: str, *, threads: int = _chunks.THREADS, local_only: bool = True):
        self._root = root
        # O_DIRECT unless FOP_DIRECT_IO=0 (or a filesystem refusing it, at the first file)
        self._direct = bool(O_DIRECT) and _env.read("FOP_DIRECT_IO") != "0"
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads,
            thread_name_prefix="fop-chunk",
            initializer=_env.initializer(local_only=local_only),
        )
        self._dirs: set[str] = set()

    def close(self) -> None:
        """Waits for every submitted write (their errors are raised by their futures)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def array(
        self,
        sub: str,
        shape: tuple[int, ...],
        chunk: tuple[int, ...],
        index: tuple[slice, ...],
        data: np.ndarray,
        crcs: dict | None = None,
    ) -> list[concurrent.futures.Future] | None:
        """Starts writing every chunk of the region ``index`` of array ``sub`` from ``data``;
        None when it is not whole chunks. ``crcs``: of chunks checksummed already."""
        region = _chunks.whole_chunks(shape, chunk, index)
        if region is None or data.shape != region[0]:
            return None
        crcs, submit = crcs or {}, functools.partial(self._pool.submit, self._write_chunk)
        return [
            submit(f"{sub}/{_chunks.chunk_key(cell)}", data[at], tuple(chunk), crcs.get(cell))
            for cell, at in region[1]
        ]

    def _write_chunk(
        self, name: str, view: np.ndarray, chunk: tuple[int, ...], crc: int | None
    ) -> None:
        payload = _chunks.chunk_payload(view, chunk)
        if crc is None:
            trailer = _chunks.crc_trailer([payload])
        else:
            trailer = np.frombuffer(crc.to_bytes(_chunks.CRC_BYTES, "little"), np.uint8)
        self._write_file(name, [payload, trailer])

    def batch(
        self, sub: str, chunk: int, inner: int, data: np.ndarray | Gathered
    ) -> list[concurrent.futures.Future]:
        """Starts writing the whole 1-D batch array ``sub`` from ``data`` (or its pieces)."""
        if isinstance(data, np.ndarray):
            data = Gathered([(0, data)], data.dtype, data.size)
        size, itemsize = data.size, data.dtype.itemsize
        sizes = (size * itemsize, chunk * itemsize, inner * itemsize)  # in bytes
        submit = functools.partial(self._pool.submit, self._write_shard)
        return [
            submit(f"{sub}/{_chunks.chunk_key((s,))}", data, s, *sizes)
            for s in range(-(-size // chunk))
        ]

    def _write_shard(
        self, name: str, data: Gathered, s: int, size: int, chunk: int, inner: int
    ) -> None:
        """Sizes in bytes. Inner chunks past ``size`` are not stored (index: missing)."""
        pieces: list[np.ndarray] = []
        entries = np.full(2 * (chunk // inner), _chunks.MISSING_ENTRY, dtype="<u8")
        offset = 0
        for j in range(chunk // inner):
            start = s * chunk + j * inner
            if start >= size:
                break
            segments = data.segments(start, start + inner, size)
            pieces += segments + [_chunks.crc_trailer(segments)]
            entries[2 * j] = offset
            entries[2 * j + 1] = inner + _chunks.CRC_BYTES
            offset += inner + _chunks.CRC_BYTES
        index = _chunks.as_bytes(entries)
        pieces += [index, _chunks.crc_trailer([index])]
        self._write_file(name, pieces)

    def _write_file(self, name: str, pieces: list[np.ndarray]) -> None:
        """Writes one chunk (``name``: its version-1 key) from ``pieces``, in order."""
        raise NotImplementedError


_ZEROS = np.zeros(1 << 17, np.uint8)
_ZEROS.flags.writeable = False


def _zeros(nbytes: int) -> np.ndarray:
    return _ZEROS[:nbytes] if nbytes <= _ZEROS.size else np.zeros(nbytes, np.uint8)


class Gathered:
    """A 1-D array as pieces ``(byte offset, C-contiguous array)``, zeros between."""

    def __init__(self, pieces: list[tuple[int, np.ndarray]], dtype, size: int):
        ordered = sorted(((int(o), _chunks.as_bytes(a)) for o, a in pieces), key=lambda p: p[0])
        self._offsets = [o for o, _ in ordered]
        self._pieces = [a for _, a in ordered]
        self.dtype = np.dtype(dtype)
        self.size = int(size)
        self.nbytes = self.size * self.dtype.itemsize

    def segments(self, start: int, stop: int, size: int) -> list[np.ndarray]:
        """Read-only uint8 arrays that are bytes ``[start, stop)`` (zeros between, past end)."""
        out: list[np.ndarray] = []
        at = start
        i = max(0, bisect.bisect_right(self._offsets, start) - 1)
        end = min(stop, size)
        while at < end and i < len(self._pieces):
            lo, piece = self._offsets[i], self._pieces[i]
            hi = lo + piece.size
            if hi <= at:
                i += 1
                continue
            if lo >= end:
                break
            if lo > at:
                out.append(_zeros(lo - at))
                at = lo
            take = min(hi, end)
            out.append(piece[at - lo : take - lo])
            at = take
            i += 1
        if at < stop:
            out.append(_zeros(stop - at))
        return out

    def assemble(self) -> np.ndarray:
        """The whole array in one aligned buffer (for tensorstore's writes)."""
        out = _host.empty((self.size,), self.dtype)
        flat = out.view(np.uint8)
        at = 0
        for lo, piece in zip(self._offsets, self._pieces, strict=True):
            flat[at:lo] = 0
            flat[lo : lo + piece.size] = piece
            at = lo + piece.size
        flat[at:] = 0
        return out


class ChunkFileWriter(ChunkWriter):
    """Version 1: each chunk (or batch shard) a file of its own under the local ``root``."""

    def _write_file(self, name: str, pieces: list[np.ndarray]) -> None:
        path = os.path.join(self._root, check_name(name))
        parent = os.path.dirname(path)
        if parent not in self._dirs:
            os.makedirs(parent, exist_ok=True)
            self._dirs.add(parent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o644)
        try:
            views = [memoryview(p) for p in pieces if p.size]
            offset = self._write_direct(fd, pieces[0]) if self._direct and pieces else 0
            if offset:
                _chunks.advance(views, offset)
                os.lseek(fd, offset, os.SEEK_SET)
            while views:
                _chunks.advance(views, os.writev(fd, views[: _chunks.IOV_MAX]))
            if _sync_file_range is not None:  # start writeback now; never waits for it
                _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
        finally:
            os.close(fd)

    def _write_direct(self, fd: int, first: np.ndarray) -> int:
        """Writes ``first``'s page-aligned head with ``O_DIRECT``; returns the bytes written."""
        skip, head = direct_span(first)  # its whole pages, when it starts on a page
        if skip or not head:
            return 0
        mode = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, mode | O_DIRECT)
        except OSError:
            self._direct = False
            return 0
        view = memoryview(first.reshape(-1).view(np.uint8))[:head]
        done = 0
        try:
            while done < head:
                done += os.pwrite(fd, view[done:], done)
        except OSError:  # the caller writes the rest buffered (and reports a real error)
            if not done:
                self._direct = False
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, mode)
        return done - done % DIRECT_ALIGN if done < head else done


LOCAL_DATA_FILE_BYTES = 1 << 30  # a data file on a local or shared filesystem
OBJECT_DATA_FILE_BYTES = 256 << 20  # an object (written whole from memory)
MAX_LANES = 4  # object stores: data files filled (and uploaded) at once
LANE_BYTES = 64 << 20  # object stores: one more lane per this many bytes to write


_UNALIGNED_DIRECT_MIN = 1 << 20  # a segment off a page goes direct from here (<0.4% padding)


class PackedWriter(ChunkWriter):
    """Writes one process's whole chunks into data files under ``location``'s ``data/``,
    each at most ``target_bytes`` unless one chunk is larger. On an object store up to
    :data:`MAX_LANES` files (one per :data:`LANE_BYTES` of ``total_bytes``) are filled
    side by side so their uploads overlap, holding at most ``gathered_bytes`` in all."""

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
        default = LOCAL_DATA_FILE_BYTES if location.is_local else OBJECT_DATA_FILE_BYTES
        self._target = int(target_bytes or default)  # fop.save's data_file_bytes (checked >= 1)
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
        self._chunks: dict[str, _chunks.Segment] = {}

    def adopt(self, files: dict[str, int], chunks: dict[str, _chunks.Segment]) -> None:
        """Lists data files (name -> size) and segments from the previous step, before any write."""
        with self._lock:
            if self._files:
                raise ValueError("adopt() comes before the first chunk")
            self._files.update(files)
            self._chunks.update(chunks)

    def encoded(self, sub: str, spec: dict[str, Any], writes: list) -> concurrent.futures.Future:
        """Starts writing ``writes`` (whole-chunk regions of ``sub``) as ``spec`` compresses."""
        if self._encoder is None:  # the process's priority: the codecs start threads
            self._encoder = concurrent.futures.ThreadPoolExecutor(
                _chunks.THREADS, thread_name_prefix="fop-encode"
            )
        return self._encoder.submit(self._write_encoded, sub, spec, writes)

    def _write_encoded(self, sub: str, spec: dict[str, Any], writes: list) -> None:
        for key, value in _arrays.encode(spec, writes):
            raw = np.frombuffer(value, np.uint8)
            if raw.size <= _chunks.CRC_BYTES:
                raise ValueError(f"{sub}/{key}: an encoded chunk of {raw.size} bytes")
            self._write_file(f"{sub}/{key}", [raw[: -_chunks.CRC_BYTES], raw[-_chunks.CRC_BYTES :]])

    def _write_file(self, name: str, pieces: list[np.ndarray]) -> None:
        check_name(name)
        pieces = [p for p in pieces if p.size]
        length = sum(p.size for p in pieces)
        crc = int.from_bytes(pieces[-1].tobytes(), "little")
        if self._location.is_local:
            first = pieces[0]
            skip, head = direct_span(first, 1 << 16) if self._direct else (0, 0)
            if skip and head < _UNALIGNED_DIRECT_MIN:  # the file's padding would cost more
                skip, head = 0, 0
            phase = None if not head else first.ctypes.data % DIRECT_ALIGN
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
            if _sync_file_range is not None:  # start writeback; no wait
                _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
        else:
            file, offset, full = self._append(_chunks.array_prefix(name), pieces, length)
            if full is not None:
                self._upload(*full)
        with self._lock:
            self._chunks[name] = _chunks.Segment(file, offset, length, crc)

    def _next_file(self) -> str:
        """Under the lock: starts data file number len(files)."""
        name = _chunks.data_file_name(self._process, len(self._files))
        self._files[name] = 0
        self._current = name
        return name

    def _allocate_local(self, length: int, phase: int | None = None) -> tuple[str, int, int]:
        """(file, offset, fd) for ``length`` bytes at an offset congruent to ``phase``."""
        with self._lock:
            name = self._current
            if name is None or (self._files[name] and self._files[name] + length > self._target):
                name = self._next_file()
                directory = os.path.join(self._location.path, _chunks.DATA_DIR)
                os.makedirs(directory, exist_ok=True)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                self._fds[name] = os.open(os.path.join(directory, name), flags, 0o644)
            offset = self._files[name]
            if phase is not None:
                offset += (phase - offset) % DIRECT_ALIGN
            self._files[name] = offset + length
            return name, offset, self._fds[name]

    def _write_direct_at(self, file: str, view: memoryview, offset: int) -> bool:
        """Writes ``view`` at ``offset`` of ``file`` with ``O_DIRECT``; False where refused."""
        try:
            with self._lock:
                fd = self._direct_fds.get(file)
                if fd is None:
                    path = os.path.join(self._location.path, _chunks.DATA_DIR, file)
                    flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | O_DIRECT
                    fd = self._direct_fds[file] = os.open(path, flags)
            done, head = 0, len(view)
            while done < head:
                done += os.pwrite(fd, view[done:], offset + done)
            return True
        except OSError:
            self._direct = False
            return False

    def _append(self, array: str, pieces, length: int):
        """Object stores: adds the pieces to the array's lane's file; (file, offset, finished)."""
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
        self._location.write_bytes(f"{_chunks.DATA_DIR}/{name}", data)

    def close(self) -> None:
        """Waits for every chunk; uploads the last objects, or closes the local files."""
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

    def index(self, dtypes: dict[str, str] | None = None) -> _chunks.DataIndex:
        """The index of everything written (after :meth:`close`), with its arrays' ``dtypes``."""
        chunks = dict(self._chunks)
        held = {_chunks.array_prefix(key) for key in chunks}
        arrays = {k: v for k, v in (dtypes or {}).items() if k in held}
        return _chunks.DataIndex(self._process, dict(self._files), chunks, arrays)

    def write_index(self, dtypes: dict[str, str] | None = None) -> tuple[str, bytes]:
        """Writes ``data/<process>.json`` (not yet durable); returns (its name, bytes)."""
        name = _chunks.index_name(self._process)
        raw = _local_files.encode(self.index(dtypes).to_json(), name, _local_files.DATA_INDEX)
        self._location.write_bytes(name, raw, durable=False)
        return name, raw
