"""Reuse on a local filesystem: hard links to the previous step's chunk files (no symlink
followed), each checked; any failure removes what was linked and the leaf is written.
A save's background thread, every process. ``docs/incremental.md``.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from .._errors import CheckpointError
from .._format.layout import LeafRecord, array_dir
from .._storage.local_files import open_dirs as _open_dirs
from .._storage.location import Location
from .chunks import (
    Refused,
    Writes,
    check_linked,
    chunk_file_bytes,
    chunk_names,
    not_the_snapshot,
    snapshot_crcs,
)

logger = logging.getLogger("flax_orbax_plugin")


def link_leaf(
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
    """Hard-links ``chunks`` (None: all) of leaf ``j`` of ``source`` into leaf ``i`` of
    ``target``, each checked against its crc32c in ``writes`` (this process's snapshot);
    returns the bytes reused (``nbytes``, or the leaf's), or None after unlinking them."""
    size = chunk_file_bytes(record)
    names = chunk_names(record) if chunks is None else chunks
    links = _Links(source, target)
    try:
        expected = snapshot_crcs(record, writes, names)
        if names:  # another process may not have created the staging item yet
            os.makedirs(links.dst_root, exist_ok=True)
        for *dirs, name in names:
            shown = f"{source}/{array_dir(j)}/{'/'.join((*dirs, name))}"
            src, dst = (*array_dir(j).split("/"), *dirs), (*array_dir(i).split("/"), *dirs)
            dfd = links.link(src, name, dst, name, shown)
            segment = (shown, 0, size, expected[(*dirs, name)])
            check_linked(dfd, name, shown, size, [segment], not_the_snapshot)
        return record.nbytes if nbytes is None else nbytes
    except (Refused, OSError, CheckpointError) as e:
        why = str(e) if isinstance(e, Refused) else f"{type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            why += " (no hard links here)"
        logger.warning(
            "incremental save: leaf %r is written, not reused from %s: %s",
            record.path,
            source,
            why,
        )
        links.undo()
        return None
    finally:
        links.close()


class _Links:
    """The directories opened (once each, ``O_NOFOLLOW``) and files linked by one call."""

    def __init__(self, source: Location, target: Location):
        self.src_root, self.dst_root = source.path.rstrip("/"), target.path.rstrip("/")
        self.fds: dict[tuple[str, tuple[str, ...]], int] = {}
        self.linked: list[tuple[int, str, str]] = []  # (dir fd, name, shown path) created here

    def _dir_fd(self, root: str, parts: tuple[str, ...], create: bool) -> int:
        key = (root, parts)
        if key not in self.fds:
            self.fds[key] = _open_dirs(root, list(parts), create=create)
        return self.fds[key]

    def link(self, src: tuple[str, ...], old: str, dst: tuple[str, ...], new: str, shown: str):
        """Links the regular file ``src/old`` (folders under the source root) as ``dst/new``
        (created under the target root); returns the fd of ``dst``."""
        sfd = self._dir_fd(self.src_root, src, False)
        dfd = self._dir_fd(self.dst_root, dst, True)
        st = os.stat(old, dir_fd=sfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{shown}: expected a regular file, found mode {st.st_mode:o}")
        os.link(old, new, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        self.linked.append((dfd, new, shown))
        return dfd

    def undo(self) -> None:
        """Unlinks every name this call linked (errors ignored)."""
        for dfd, name, _ in self.linked:
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
