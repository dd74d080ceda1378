"""The save's request, the entry points' options, the format seam (one ``Format`` a version).

Options are checked once, the entry point's first act, on the caller's thread; a request
never changes; the write runs on the save's background thread, the read on the restoring one.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.formats``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
from typing import Any, Protocol

from .._base import distributed as _distributed
from .._base.env import INT64_MAX, Option, check
from .._base.host_memory import HOST_MEMORY_BUDGET, BufferPool
from .._base.keywords import refuse_without
from .._errors import CorruptCheckpointError
from .._format import layout as _layout
from .._format.layout import BatchRecord, CheckpointDocument
from .._incremental import reuse as _reuse
from .._storage.location import Location
from .._zarr import chunks as _chunks
from .._zarr import packed_reader as _packed_reader
from . import reads as _reads
from .format_v1 import CHUNK_FILES
from .host_snapshot import write_packed
from .reads import check_claims

DEFAULT_FORMAT_VERSION = 2  # FORMAT.md; version 1 on request and in a directory per host

DEFAULT_WRITE_LIMIT_BYTES = 1 << 30  # bytes of writes in flight, by default


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """How one pytree is saved (the options of ``fop.save_async``, checked, plus what a
    manager adds per step and item).

    ``format_version``: 2 (data files, the default) or 1 (chunk files), the one place the save's
    format is chosen; ``compression``: a checked codec or None;
    ``memory_limit_bytes``: writes in flight (None: the default, see :attr:`limit`);
    ``host_memory_budget``: host bytes the save may hold beyond the state;
    ``data_file_bytes``: version 2's data file size; ``own_copy``: a host's own
    directory (every process writes all it holds and every JSON file);
    ``created_at``: the document's time (the same on every process for an own copy;
    None: when written); ``reuse``: an ``_incremental.Reuse`` (a manager with
    ``incremental=True``) or None; ``buffers``: a manager's host buffers or None;
    ``cancelled``: set when the save is cancelled (Ctrl-C): its writes stop;
    ``region``: the collective operation the save is part of (``_base.distributed``:
    its names are drawn there, its waits look at its failures; by default one that
    spans nothing).
    """

    format_version: int = DEFAULT_FORMAT_VERSION
    compression: str | None = None
    memory_limit_bytes: int | None = None
    host_memory_budget: int | None = None
    data_file_bytes: int | None = None
    own_copy: bool = False
    created_at: float | None = None
    reuse: Any = None
    buffers: BufferPool | None = None
    cancelled: threading.Event | None = None
    region: _distributed.Region = dataclasses.field(
        default_factory=lambda: _distributed.Region("save"), compare=False
    )

    def __post_init__(self):
        if self.own_copy and self.created_at is None:
            raise ValueError("SaveRequest: own_copy needs created_at (the agreed time)")

    @property
    def limit(self) -> int:
        """The bytes of writes in flight, ``memory_limit_bytes`` (default
        ``DEFAULT_WRITE_LIMIT_BYTES``), at most half the host memory budget."""
        limit = self.memory_limit_bytes or DEFAULT_WRITE_LIMIT_BYTES
        budget = self.host_memory_budget
        return limit if budget is None else max(1, min(limit, budget // 2))

    def replace(self, **fields: Any) -> SaveRequest:
        return dataclasses.replace(self, **fields)


MEMORY_LIMIT = Option(
    "memory_limit_bytes",
    "int",
    none_ok=True,
    low=1,
    high=INT64_MAX,
    expected=f"a positive int <= {INT64_MAX} or None",
)


SAVE: tuple[Option, ...] = (
    Option("force", "flag"),
    MEMORY_LIMIT,
    Option(
        "compression",
        "str",
        none_ok=True,
        convert=_layout.check_codec,  # its errors name "compression"
        expected="None, 'zstd' or 'zstd:<level 1-22>'",
    ),
    Option("format_version", "choice", choices=(1, 2), none_ok=True),  # None: the default
    dataclasses.replace(MEMORY_LIMIT, name="data_file_bytes"),  # the same bounds
    HOST_MEMORY_BUDGET,
)


def check_save(**options: Any) -> dict[str, Any]:
    """``fop.save``'s options checked; one the chosen format ignores is refused too."""
    out = check(SAVE, options)
    out["format_version"] = version_for(out["format_version"], per_host=False)
    refuse_ignored(
        out["format_version"], out, lambda name, needs: refuse_without(name, out[name], needs)
    )
    return out


@dataclasses.dataclass(frozen=True)
class Written:
    """What one process wrote: array bytes and ``{relative JSON file: sha256}``; plus the
    array bytes it hard-linked or copied on the server from the previous step instead
    (incremental steps)."""

    bytes_written: int = 0
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    bytes_reused: int = 0


class Format(Protocol):
    """One on-disk layout of a pytree's data. Call order on save (the background thread,
    every process): :meth:`reuser` and :meth:`wrote` while planning reuse, then :meth:`write`
    once. On read (the caller's thread): :meth:`open`, the reads, then ``close()``."""

    version: int
    copies_before_writing: bool  # every region on host before the write starts
    per_host_directories: bool  # a directory per host (of a manager step) is written
    ignored_options: tuple[tuple[str, str], ...]  # (option, what makes it count): refused
    batch_damage: tuple[type[BaseException], ...]  # a batch store's opening on damage
    array_specs: bool  # every array has its own ``zarr.json``, opened through tensorstore

    def write(
        self, snap: Any, location: Location, leaves: list, *, primary: bool, found: Any
    ) -> tuple:
        """This process's data of ``snap``: (bytes written, {file: sha256}, bytes reused)."""

    def reuser(self, location: Location) -> Any:
        """How this process reuses unchanged data under ``location`` (None: it cannot)."""

    def wrote(self, doc: CheckpointDocument) -> bool:
        """Whether ``doc`` (a previous step's) was written in this format."""

    def open(self, location: Location, doc: CheckpointDocument, targets: list, *, own_copy: bool):
        """The reader, the claims checked first (None: tensorstore reads everything)."""

    def array_store(self, location: Location, target: Any, paths: list[str]) -> Any:
        """What tensorstore reads an array through (None: the reader alone)."""

    def read_stored(self, store: Any, index: int, record: Any, direct: Any, region: Any) -> Any:
        """A read of ``region`` (None: all) of leaf ``index``'s stored array (``record``)."""

    def batch_store(self, location: Location, batch: BatchRecord, direct, paths) -> Any:
        """What a batch is read through (raises one of :attr:`batch_damage` on damage)."""

    def reads_batch_runs(self, direct: Any, batch: BatchRecord) -> bool:
        """Whether a batch's leaves are read in runs straight from its chunk files."""

    def check_lengths(self, location: Location, direct: Any) -> None:
        """``verify`` only: CorruptCheckpointError for a file longer than was written."""


class DataFiles:
    """Version 2: each process's chunks in a few data files and one JSON index."""

    version = 2
    copies_before_writing = False
    per_host_directories = False
    ignored_options = ()
    batch_damage: tuple[type[BaseException], ...] = (ValueError,)
    array_specs = False

    def write(
        self, snap: Any, location: Location, leaves: list, *, primary: bool, found: Any
    ) -> tuple:
        reuse = None if found is None else _files_reuse(location, *found)
        return write_packed(location, leaves, snap, reuse)

    def reuser(self, location: Location) -> Any:
        return _reuse.reuser(location, link=_reuse.link_file, copy=_reuse.copy_file)

    def wrote(self, doc: CheckpointDocument) -> bool:
        return doc.format_version == 2

    def open(self, location: Location, doc: CheckpointDocument, targets: list, *, own_copy: bool):
        try:
            reader = _packed_reader.open_packed(location, doc.process_count, listed=doc.listed)
        except ValueError as e:
            _reads.raise_environmental(e)
            raise CorruptCheckpointError(f"{location}: {e}") from None
        try:
            check_claims(location, doc, targets, packed=reader)
        except BaseException:
            reader.close()
            raise
        return reader

    def array_store(self, location: Location, target: Any, paths: list[str]) -> Any:
        return None  # every array is read through the data files' reader

    def read_stored(self, store: Any, index: int, record: Any, direct: Any, region: Any) -> Any:
        read = _reads.plain_read(index, record, direct, region)
        if read is not None:
            return read
        return direct.read_compressed(index, record, region)

    def batch_store(self, location: Location, batch: BatchRecord, direct, paths) -> Any:
        return direct.compressed_batch(batch)  # compressed: its shards fetched; else None

    def reads_batch_runs(self, direct: Any, batch: BatchRecord) -> bool:
        return batch.codec is None and direct.reads_ranges  # the needed inner chunks alone

    def check_lengths(self, location: Location, direct: Any) -> None:
        for name, (found, recorded) in direct.file_lengths().items():
            if found != recorded:
                raise CorruptCheckpointError(
                    f"{location}: data file {name}: expected {recorded} bytes (its data "
                    f"index), found {found}"
                )


DATA_FILES = DataFiles()
_BY_VERSION: dict[int, Format] = {1: CHUNK_FILES, 2: DATA_FILES}


def check_version(value: Any, *, where: str = "format_version") -> int:
    """``value`` if it names a format this library writes; OptionError otherwise."""
    return Option(where, "choice", choices=tuple(_BY_VERSION)).check(value)


def for_version(version: int) -> Format:
    """The format a save writes (its request's ``format_version``, already checked)."""
    return _BY_VERSION[version]


def of_document(doc: CheckpointDocument) -> Format:
    """The format a checkpoint was written in (its checked metadata's version)."""
    return _BY_VERSION[doc.format_version]


def version_for(asked: int | None, *, per_host: bool) -> int:
    """``asked``, else the default (version 1 in a directory per host)."""
    if asked is not None:
        return asked
    if per_host and not for_version(DEFAULT_FORMAT_VERSION).per_host_directories:
        return CHUNK_FILES.version
    return DEFAULT_FORMAT_VERSION


def refuse_ignored(version: int | None, given: dict[str, Any], refuse) -> None:
    """``refuse(name, needs)`` for every option given that ``version`` ignores."""
    version = DEFAULT_FORMAT_VERSION if version is None else version
    for name, needs in for_version(version).ignored_options:
        if name in given:
            refuse(name, needs)


def _files_reuse(location: Location, way, source: Location, unchanged: list):
    """``reuse()``: takes this process's previous data files of mostly unchanged leaves."""
    if not unchanged:
        return None
    leaves = {
        leaf.index: _reuse.Unchanged(
            j, leaf.record, chunks, leaf.writes, sum(d.nbytes for _, d in leaf.writes)
        )
        for leaf, j, chunks in unchanged
    }
    process = _distributed.process_index()
    return functools.partial(_reuse.reuse_files, way, source, location, process, leaves)


# -- the names a checkpoint's files have (both formats) --------------------------------

_DATA_NAME = re.compile(r"^(0|[1-9][0-9]{0,8})(-(0|[1-9][0-9]{0,8})\.bin|\.json)$", re.ASCII)
_TOP_FILES = (_layout.COMMIT_FILE, _layout.METADATA_FILE, _layout.PENDING_FILE)


def checkpoint_names(parts: list[str], is_dir: bool) -> bool:
    """Whether the library writes the entry at ``parts``: else never read, never removed."""
    head, rest = parts[0], parts[1:]
    if head in (_layout.ARRAYS_DIR, _layout.BATCHES_DIR):
        return is_dir or bool(rest)
    if head == _chunks.DATA_DIR:
        if not rest:
            return is_dir
        return len(rest) == 1 and not is_dir and bool(_DATA_NAME.match(rest[0]))
    return not rest and not is_dir and head in _TOP_FILES
