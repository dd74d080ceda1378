"""A local directory as a whole: the bytes it holds, its newest change, its removal; each
walked with ``lstat``, never following a link.

Only listings (the command line's sizes, an import's), the check of a stale staging
directory and a hand-made cleanup run this; a save or restore reads and writes single
files (``local_files``). Pure functions of paths: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.local_files``.
"""

from __future__ import annotations

import os
import shutil
import stat

from .._errors import ForeignEntryError
from .untrusted import entry_kind


def size_bytes(path: str) -> int | None:
    """Total bytes of the files under ``path`` (``lstat``: links counted, not followed);
    None when part of it cannot be read (a total without it would look whole)."""
    total, unread = 0, []
    for root, _, files in os.walk(path, onerror=unread.append):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass  # removed meanwhile
            except OSError as e:
                unread.append(e)
    return None if unread else total


def remove_tree(path: str) -> None:
    """Removes the real directory ``path`` (no trailing '/'); symlinks inside it are
    unlinked, never followed; a ``path`` that is itself a symlink or not a directory is
    refused with ForeignEntryError. No error if nothing is there."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISDIR(st.st_mode):
        raise ForeignEntryError(
            f"refusing to remove {path}: expected a directory this library created, "
            f"found {entry_kind(st.st_mode)} (nothing was removed)"
        )
    shutil.rmtree(path, ignore_errors=True)  # fd-based: never follows a link


def newest_mtime(path: str) -> float:
    """The latest modification time of the directory ``path`` and its immediate entries
    (``lstat``: no link followed); ``inf`` when it cannot be read."""
    try:
        times = [os.lstat(path).st_mtime]
        with os.scandir(path) as it:
            times += [e.stat(follow_symlinks=False).st_mtime for e in it]
    except OSError:
        return float("inf")
    return max(times)
