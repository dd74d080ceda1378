"""Reuse on an object store: server-side copies of the previous step's chunk objects, each
checked before and after; any failure deletes its copies and the leaf is written (never
failing the save). A save's background thread, every process. ``docs/incremental.md``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

from .._format.layout import LeafRecord, array_dir
from .._storage import server_copy as _server_copy
from .._storage.location import Location
from .._zarr import chunks as _chunks
from .chunks import (
    CRC_BYTES,
    Refused,
    Writes,
    chunk_file_bytes,
    chunk_names,
    not_the_snapshot,
    snapshot_crcs,
)

logger = logging.getLogger("flax_orbax_plugin")

COPIES_IN_FLIGHT = 16  # per leaf; each is one request, the bytes stay on the server


def copy_leaf(
    copier: _server_copy.Copier,
    source: Location,
    j: int,
    target: Location,
    i: int,
    record: LeafRecord,
    *,
    writes: Writes,
    chunks: list[tuple[str, ...]] | None = None,
    nbytes: int | None = None,
) -> int | None:
    """Copies ``chunks`` (None: all) of leaf ``j`` of ``source`` to leaf ``i`` of ``target``
    on the server, checked (:class:`_LeafCopy`); returns the bytes reused (``nbytes``, or
    the leaf's), or None after deleting whatever it copied."""
    size = chunk_file_bytes(record)
    if source.spec | {"path": ""} != target.spec | {"path": ""}:
        return None
    leaf = _LeafCopy(copier, source, j, target, i, size)
    every = {"/".join(parts[1:]) for parts in chunk_names(record)}
    wanted = sorted(every if chunks is None else ("/".join(p[1:]) for p in chunks))
    if not wanted:
        return 0 if nbytes is None else nbytes
    started = False
    try:
        crcs = snapshot_crcs(
            record, writes, [(_chunks.CHUNK_DIR, *name.split("/")) for name in wanted]
        )
        expected = {"/".join(parts[1:]): crc for parts, crc in crcs.items()}
        listed = leaf.check_listing(wanted, every)
        started = True
        answers = leaf.copy_all(wanted, listed, expected)
        leaf.check_copies(wanted, listed, answers)
        return record.nbytes if nbytes is None else nbytes
    except Exception as e:  # noqa: BLE001  (a copier's failure never fails the save)
        why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
        logger.warning(
            "incremental save: leaf %r is written, not copied from %s: %s",
            record.path,
            source,
            why,
        )
        if started:
            _delete_copies(copier, leaf.dst_prefix, wanted)
        return None


@dataclasses.dataclass(frozen=True)
class _LeafCopy:
    """The copies of one leaf's chunks (``size`` bytes each), made and checked in order
    (:meth:`check_listing`, :meth:`copy_all`, :meth:`check_copies`): the previous step
    lists exactly the leaf's chunks; each copy is pinned to the object listed (S3
    ``If-Match``, GCS generation); each source's crc32c trailer is the snapshot's; each
    copy's answer and listing carry the source's size and tag (:func:`_same_copy`). A
    chunk damaged under its old trailer is copied as is: restore and ``verify`` say so."""

    copier: _server_copy.Copier
    source: Location
    j: int
    target: Location
    i: int
    size: int

    @property
    def src_prefix(self) -> str:
        return f"{self.source.path}{array_dir(self.j)}/{_chunks.CHUNK_DIR}/"

    @property
    def dst_prefix(self) -> str:
        return f"{self.target.path}{array_dir(self.i)}/{_chunks.CHUNK_DIR}/"

    def check_listing(
        self, wanted: list[str], every: set[str]
    ) -> dict[str, _server_copy.ObjectInfo]:
        """``{chunk name: listed object}``: every chunk ``wanted``, a chunk's size, no other."""
        source, j, size, src_prefix = self.source, self.j, self.size, self.src_prefix
        listed = {k[len(src_prefix) :]: v for k, v in self.copier.list(src_prefix).items()}
        for name in wanted:
            info = listed.get(name)
            if info is None:
                raise Refused(f"{source}/d/{j}/c/{name}: missing")
            if info.size != size:
                raise Refused(
                    f"{source}/d/{j}/c/{name}: expected {size} bytes (one chunk), found {info.size}"
                )
        extra = sorted(set(listed) - every)
        if extra:
            raise Refused(f"{source}/d/{j}/c/{extra[0]}: not a chunk of this leaf")
        return listed

    def copy_all(
        self,
        wanted: list[str],
        listed: dict[str, _server_copy.ObjectInfo],
        expected: dict[str, int],
    ) -> dict[str, _server_copy.ObjectInfo]:
        """Each chunk's copy answer, its source's crc32c trailer checked first."""
        copier, size = self.copier, self.size
        src_prefix, dst_prefix = self.src_prefix, self.dst_prefix

        def check_and_copy(name: str) -> _server_copy.ObjectInfo:
            info = listed[name]
            tail = copier.read_range(src_prefix + name, size - CRC_BYTES, size, info)
            stored = int.from_bytes(tail, "little")
            if stored != expected[name]:
                raise Refused(
                    not_the_snapshot(f"{self.source}/d/{self.j}/c/{name}", stored, expected[name])
                )
            return copier.copy(src_prefix + name, dst_prefix + name, info)

        with concurrent.futures.ThreadPoolExecutor(
            min(COPIES_IN_FLIGHT, len(wanted)), thread_name_prefix="fop-copy"
        ) as pool:
            futures = {name: pool.submit(check_and_copy, name) for name in wanted}
            return {name: f.result() for name, f in futures.items()}  # first error raised

    def check_copies(
        self,
        wanted: list[str],
        listed: dict[str, _server_copy.ObjectInfo],
        answers: dict[str, _server_copy.ObjectInfo],
    ) -> None:
        """A listing of the new keys shows each copy as :func:`_same_copy` requires."""
        dst_prefix = self.dst_prefix
        copied = {k[len(dst_prefix) :]: v for k, v in self.copier.list(dst_prefix).items()}
        for name in wanted:
            want, answer, seen = listed[name], answers[name], copied.get(name)
            if not _same_copy(want, answer, seen):
                raise Refused(
                    f"{self.target}/d/{self.i}/c/{name}: the copy is not the same object as "
                    f"{self.source}/d/{self.j}/c/{name} (source {want}, copy {answer}, "
                    f"listed {seen})"
                )


def _same_copy(
    source: _server_copy.ObjectInfo,
    answer: _server_copy.ObjectInfo,
    listed: _server_copy.ObjectInfo | None,
) -> bool:
    """The copy's answer and the new key's listing carry the source's size and tag."""
    if listed is None or answer.size != source.size or listed.size != source.size:
        return False
    if source.content_tag and answer.content_tag and source.tag and answer.tag:
        if answer.tag != source.tag:
            return False
    return not (answer.tag and listed.tag and listed.tag != answer.tag)


def _delete_copies(copier: _server_copy.Copier, prefix: str, names: list[str]) -> None:
    """Deletes this process's copies ``prefix + name``; errors ignored (the write replaces)."""
    mine = set(names)
    try:
        for key in copier.list(prefix):
            if key[len(prefix) :] in mine:
                copier.delete(key)
    except OSError:
        pass
