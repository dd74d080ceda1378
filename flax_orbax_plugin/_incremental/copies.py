"""Reuse on an object store: server-side copies of the previous step's chunk objects.

:func:`copy_leaf` lists the previous step's chunks of an unchanged leaf, checks each
source's crc32c trailer against the snapshot's (:mod:`.chunks`), copies this process's
chunks on the server (S3 ``CopyObject``, GCS ``rewriteTo``; up to
:data:`COPIES_IN_FLIGHT` at once per leaf, each pinned to the object listed), then
checks the copies. Any failure deletes this process's copies and the caller writes the
leaf; a copier's failure never fails the save. Called on the background thread of a
save, on every process. Design: ``docs/incremental.md``.
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
    """Copies the chunk objects ``chunks`` (all of them when None) of leaf ``j`` of
    ``source`` (the previous step's item) to leaf ``i`` of ``target`` (the new step's
    item) on the server, then checks them; returns ``nbytes`` (the bytes reused; the
    leaf's when None), or None after deleting whatever it copied (the caller writes
    those chunks; the other processes' copies are theirs). The checks: :class:`_LeafCopy`."""
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
    """The copies of one leaf's chunks (``size`` bytes each) from leaf ``j`` of ``source``
    to leaf ``i`` of ``target``, made and checked in order: :meth:`check_listing`,
    :meth:`copy_all` (a thread pool), :meth:`check_copies`.

    Checked: the previous step lists exactly the leaf's chunk objects (every chunk is
    stored, fill values included), each of the size a chunk has; each copy is made
    only from the object listed (S3 ``If-Match`` its ETag, GCS its generation); each
    copy's answer carries the source's content tag (S3 ETag, GCS crc32c and md5; not
    compared where the tag is no hash of the bytes: S3 multipart or SSE-KMS/SSE-C),
    and a listing of the new keys afterwards shows each of the source's size and the
    tag the copy answered (:func:`_same_copy`); and before each copy, the source's
    crc32c trailer (its last 4 bytes, one ranged read pinned to the object listed)
    equals the crc32c of the snapshot's bytes for that chunk (``writes``, this
    process's ``(region, data)`` pairs of the leaf): a chunk edited and resealed is
    refused. The source's other bytes are not read here: a chunk damaged in place
    under its old trailer is copied as is, and restore and ``verify`` report it in
    both steps (never silently wrong)."""

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
        """``{chunk name: listed object}`` of the source leaf: every chunk ``wanted``
        there, of a chunk's size, and nothing that is not a chunk of the leaf."""
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
        """Each chunk's copy answer, after checking its source's crc32c trailer against
        ``expected``; the first error raised."""
        copier, size, src_prefix, dst_prefix = (
            self.copier,
            self.size,
            self.src_prefix,
            self.dst_prefix,
        )

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
    """The copy's answer has the source's size and, where both tags are content tags,
    its tag; the new key's listing has that size and the answer's tag (the object the
    copy made, unchanged since)."""
    if listed is None or answer.size != source.size or listed.size != source.size:
        return False
    if source.content_tag and answer.content_tag and source.tag and answer.tag:
        if answer.tag != source.tag:
            return False
    return not (answer.tag and listed.tag and listed.tag != answer.tag)


def _delete_copies(copier: _server_copy.Copier, prefix: str, names: list[str]) -> None:
    """Deletes the objects ``prefix + name`` for ``names`` (this process's chunks of one
    leaf of the new step, which only this save writes; other processes' chunks under
    ``prefix`` are left alone); errors are ignored (the write replaces them)."""
    mine = set(names)
    try:
        for key in copier.list(prefix):
            if key[len(prefix) :] in mine:
                copier.delete(key)
    except OSError:
        pass
