"""What an export writes and replaces, on local disk: output names, the staged files
(:class:`Staged`), the proof that an existing file is ours. Single process, one thread.
Rules: ``docs/safetensors.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

from ..._base import env as _env
from ..._errors import CheckpointNotFoundError, CorruptCheckpointError, ForeignEntryError
from ..._storage.untrusted import loads_json, open_regular
from . import remains as _remains
from .headers import (
    DEFAULT_STEM,
    INDEX_SUFFIX,
    MARKER_KEY,
    MARKER_VALUE,
    MAX_INDEX_BYTES,
    SHARD_NAME_RE,
    header_json,
    plain_name,
    pread_exact,
)
from .plan import Tensor, encode_header, split_shards, tensor_bytes

_log = logging.getLogger(__package__)


def output_names(out: str, count: int) -> tuple[str, list[str], str]:
    """(directory, file names, index name) for ``out``: a ``*.safetensors`` path or folder."""
    if out.endswith(".safetensors"):
        directory, stem = os.path.dirname(os.path.abspath(out)), os.path.basename(out)[:-12]
    else:
        directory, stem = os.path.abspath(out), DEFAULT_STEM
    there = directory  # the deepest part of it that exists: a directory, or refused
    while not os.path.lexists(there):
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        raise FileExistsError(
            f"{out}: expected a directory for the export (or a path ending in "
            f".safetensors), found a file at {there}"
        )
    names = [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    return directory, names if count > 1 else [f"{stem}.safetensors"], f"{stem}{INDEX_SUFFIX}"


def proven_ours(path: str) -> tuple[dict | None, str]:
    """(its index document or header, "") when ``path`` is a regular file whose metadata
    carries our marker, else (None, what was found). Opens without following or blocking."""
    try:
        fd, st = open_regular(path, follow_links=False, what="file")
    except CheckpointNotFoundError:
        return None, "nothing"
    except (ForeignEntryError, OSError) as e:
        return None, str(e)
    try:
        if path.endswith(INDEX_SUFFIX):
            if st.st_size > MAX_INDEX_BYTES:
                return None, f"an index of {st.st_size} bytes"
            doc = loads_json(pread_exact(fd, st.st_size, 0, path, "index"), path)
            meta = doc.get("metadata") if isinstance(doc, dict) else None
        else:
            _, doc = header_json(fd, st.st_size, path)
            meta = doc.get("__metadata__")
    except (CorruptCheckpointError, OSError) as e:
        return None, f"a file that is not one of our exports ({e})"
    finally:
        os.close(fd)
    if isinstance(meta, dict) and meta.get(MARKER_KEY) == MARKER_VALUE:
        return doc, ""
    return None, f"a file without the {MARKER_KEY!r} marker this library writes"


def remove_if_ours(directory: str, name: str, stem: str) -> None:
    """Removes ``directory/name`` when named like our shards and proven ours, else warns."""
    path = os.path.join(directory, name)
    if not re.fullmatch(SHARD_NAME_RE.format(stem=re.escape(stem)), name):
        _log.warning("%s: listed by the old index but not named like our shards; left alone", path)
        return
    ours, found = proven_ours(path)
    if ours is None:
        if found != "nothing":
            _log.warning("%s: listed by the old index, but %s; left alone", path, found)
        return
    os.unlink(path)  # the name itself: a link put there since would be unlinked, not followed


def old_outputs(directory: str, index_name: str) -> set[str]:
    """Files an index of ours in ``directory`` lists, and the index (none if not ours)."""
    index, _ = proven_ours(os.path.join(directory, index_name))
    if index is None:
        return set()
    weight_map = index.get("weight_map")
    listed = weight_map.values() if isinstance(weight_map, dict) else ()
    return {v for v in listed if isinstance(v, str) and plain_name(v)} | {index_name}


def check_outputs(directory: str, names: list[str], index_name: str, force: bool) -> None:
    """An existing output: FileExistsError without ``force``, else ForeignEntryError if not ours."""
    single = names[0] if len(names) == 1 else index_name.replace(INDEX_SUFFIX, ".safetensors")
    targets = sorted({*names, index_name, single})
    clash = [n for n in targets if os.path.lexists(os.path.join(directory, n))]
    if not clash:
        return
    if not force:
        raise FileExistsError(
            f"{os.path.join(directory, clash[0])} exists; pass force=True (--force) "
            f"to replace the export"
        )
    for name in clash:
        ours, found = proven_ours(os.path.join(directory, name))
        if ours is None and found != "nothing":
            raise ForeignEntryError(
                f"{os.path.join(directory, name)}: expected an earlier export of this library "
                f"to replace, found {found}; it is left alone (nothing was written)"
            )


def remove_stale(
    directory: str, index_name: str, names: list[str], old: set[str], *, force: bool, sharded: bool
) -> None:
    """Removes (:func:`remove_if_ours`) what an old export left that this one did not write."""
    stem = index_name[: -len(INDEX_SUFFIX)]
    for stale in sorted(old - set(names) - ({index_name} if sharded else set())):
        remove_if_ours(directory, stale, stem)  # only files an old index listed
    single = os.path.join(directory, index_name.replace(INDEX_SUFFIX, ".safetensors"))
    if force and sharded and os.path.lexists(single):
        remove_if_ours(directory, os.path.basename(single), stem)  # an unsharded export


_GROUP_BYTES = 64 << 20  # leaves read per partial restore when exporting a checkpoint


def _groups(tensors: list[Tensor], limit: int | None) -> list[list[Tensor]]:
    """Leaves read per partial restore: groups of at most ``limit`` (or _GROUP_BYTES)."""
    size = _GROUP_BYTES if limit is None else min(_GROUP_BYTES, limit)
    return [g for g in split_shards(tensors, size) if g]


class Staged:
    """The temporary files of one export, named by its marker's nonce: :meth:`write`,
    :meth:`place` each shard, :meth:`write_index`, :meth:`done` (or :meth:`discard`). One thread."""

    def __init__(
        self, directory: str, names: list[str], shards: list[list[Tensor]], meta: dict[str, str]
    ):
        self.directory, self.names, self.shards, self.meta = directory, names, shards, meta
        self.tmps: list[str] = []  # every temporary file this call created (and only those)
        self.shard_of = {t.path: i for i, shard in enumerate(shards) for t in shard}
        self.file: Any = None  # the shard being written: shards are written in order
        self.placed: list[tuple[str, int]] = []  # (final path, inode) renamed into place
        self.nonce = _remains.begin(directory)  # before any file: remains proven ours

    @property
    def shard_tmps(self) -> list[str]:
        return self.tmps[: len(self.shards)]

    def _create(self, final_name: str) -> Any:
        """A new binary file under ``final_name``'s temporary name, created exclusively."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        path = os.path.join(self.directory, _remains.temp_name(final_name, self.nonce))
        f = os.fdopen(os.open(path, flags, 0o644), "wb")
        self.tmps.append(path)
        return f

    def _open_shard(self, i: int) -> None:
        """Shard ``i`` open for writing; the shards before it durable and closed."""
        while len(self.tmps) <= i:
            if self.file is not None:
                _close_durable(self.file)
            n = len(self.tmps)
            self.file = self._create(self.names[n])
            self.file.write(encode_header(self.shards[n], self.meta))

    def write(
        self, tensors: list[Tensor], read: Callable, bar, *, group_bytes: int | None = None
    ) -> None:
        """Every shard, durable and closed, the tensors read a group at a time."""
        by_path = {t.path: t for t in tensors}
        for group in _groups(tensors, group_bytes):
            for path, value in read([t.path for t in group]):
                self._open_shard(self.shard_of[path])
                data = tensor_bytes(by_path[path], value)
                self.file.write(memoryview(data))
                _env.pause_point("export_write")
                _env.slow_point("export_write")
                if bar is not None:
                    bar.advance(data.nbytes, path)
                del data, value  # one leaf (or one group) in memory at a time
        self._open_shard(len(self.shards) - 1)
        _close_durable(self.file)

    def write_index(
        self, tensors: list[Tensor], total: int, index_name: str, index_path: str
    ) -> None:
        """The index, durable, renamed into place once the shards are."""
        index = {
            "metadata": {"total_size": total, MARKER_KEY: MARKER_VALUE},
            "weight_map": {t.name: self.names[self.shard_of[t.path]] for t in tensors},
        }
        with self._create(index_name) as f:
            f.write(json.dumps(index, indent=2, sort_keys=True).encode("utf-8"))
            _close_durable(f)
        self.place(self.tmps[-1], index_path)

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
        if self.file is not None and not self.file.closed:
            self.file.close()
        for tmp in self.tmps:  # ours: created exclusively under an unpredictable name
            with contextlib.suppress(FileNotFoundError):  # placed already
                os.unlink(tmp)
        for final, inode in self.placed:  # a file this export put in place: still ours
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(final).st_ino == inode:
                    os.unlink(final)
        _remains.end(self.directory, self.nonce)  # last: what it names is gone


def _close_durable(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()
