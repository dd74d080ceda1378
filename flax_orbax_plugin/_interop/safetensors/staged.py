"""The files one export writes, under temporary names until they are in place
(:class:`Staged`), and its progress bar. Single process, one thread.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

from ..._base import env as _env
from . import remains as _remains
from .headers import MARKER_KEY, MARKER_VALUE
from .outputs import close_shard, create_temp
from .plan import Tensor, encode_header, split_shards, tensor_bytes

_GROUP_BYTES = 64 << 20  # leaves read per partial restore when exporting a checkpoint


def _groups(tensors: list[Tensor], limit: int | None) -> list[list[Tensor]]:
    """Leaves read per partial restore: groups of at most ``limit`` (or _GROUP_BYTES)."""
    size = _GROUP_BYTES if limit is None else min(_GROUP_BYTES, limit)
    return [g for g in split_shards(tensors, size) if g]


class Staged:
    """The temporary files of one export, named by its nonce after its marker: call
    :meth:`write`, :meth:`place` each shard, :meth:`write_index`, then :meth:`done`;
    or on failure :meth:`discard` (every file it created, then the marker). One thread."""

    def __init__(
        self, directory: str, names: list[str], shards: list[list[Tensor]], meta: dict[str, str]
    ):
        self.directory, self.names, self.shards, self.meta = directory, names, shards, meta
        self.tmps: list[str] = []  # every temporary file this call created (and only those)
        self.shard_of = {t.path: i for i, shard in enumerate(shards) for t in shard}
        self.files: list[Any] = [None] * len(shards)
        self.shard_tmps: list[str | None] = [None] * len(shards)
        self.placed: list[tuple[str, int]] = []  # (final path, inode) renamed into place
        self.nonce = _remains.begin(directory)  # before any file: remains proven ours

    def _start(self, i: int) -> Any:
        tmp, f = create_temp(self.directory, self.names[i], self.nonce)
        self.tmps.append(tmp)
        self.shard_tmps[i] = tmp
        f.write(encode_header(self.shards[i], self.meta))
        return f

    def write(
        self, tensors: list[Tensor], read: Callable, bar, *, group_bytes: int | None = None
    ) -> None:
        """Every shard, durable and closed, the tensors read a group at a time."""
        by_path = {t.path: t for t in tensors}
        files, current = self.files, -1
        for group in _groups(tensors, group_bytes):
            for path, value in read([t.path for t in group]):
                i = self.shard_of[path]
                if i != current:
                    close_shard(files, current)
                    files[i] = self._start(i)
                    current = i
                t = by_path[path]
                data = tensor_bytes(t, value)
                files[i].write(memoryview(data))
                _env.pause_point("export_write")
                _env.slow_point("export_write")
                bar.advance(data.nbytes, path)
                del data, value  # one leaf (or one group) in memory at a time
        close_shard(files, current)
        for i in range(len(self.shards)):
            if files[i] is None:  # a shard of empty tensors only
                files[i] = self._start(i)
                close_shard(files, i)

    def write_index(
        self, tensors: list[Tensor], total: int, index_name: str, index_path: str
    ) -> None:
        """The index, durable, renamed into place once the shards are."""
        index = {
            "metadata": {"total_size": total, MARKER_KEY: MARKER_VALUE},
            "weight_map": {t.name: self.names[self.shard_of[t.path]] for t in tensors},
        }
        tmp, f = create_temp(self.directory, index_name, self.nonce)
        self.tmps.append(tmp)
        with f:
            f.write(json.dumps(index, indent=2, sort_keys=True).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        self.place(tmp, index_path)

    def place(self, tmp: str, final: str) -> None:
        """Renames ``tmp`` over ``final`` (a name replaced, never written through a link)."""
        inode = os.lstat(tmp).st_ino
        os.replace(tmp, final)
        self.placed.append((final, inode))
        _env.pause_point("export_placed")

    def done(self) -> None:
        """Every file is in place: the marker goes."""
        _remains.end(self.directory, self.nonce)

    def discard(self) -> None:
        _env.pause_point("export_discard")  # tests: a second signal during the clean-up
        for f in self.files:
            if f is not None and not f.closed:
                f.close()
        for tmp in self.tmps:  # ours: created exclusively under an unpredictable name
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        for final, inode in self.placed:  # a file this export put in place: still ours
            try:
                if os.lstat(final).st_ino == inode:
                    os.unlink(final)
            except FileNotFoundError:
                pass
        _remains.end(self.directory, self.nonce)  # last: what it names is gone


class _NoBar:
    def advance(self, amount: int = 1, note: str = "") -> None:
        pass


def progress_of(factory, total):
    return factory(total) if factory is not None else contextlib.nullcontext(_NoBar())
