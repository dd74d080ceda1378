"""How a commit becomes visible on a local path: a directory rename, or a file written last.

A step (or a core checkpoint) on local disk is staged under a name of its own and
renamed into place: one atomic ``rename(2)``. On a FUSE mount that stands for an object
store (GCS Fuse, the usual way TPU VMs see a bucket; s3fs, mountpoint-s3 ...) a
directory rename is neither atomic nor cheap: it copies every file, one by one, so a
crash midway leaves a directory that holds part of a step under the step's name.
There the library commits as on an object store: the step is written in place, under
its pending marker, and the step manifest, written last (a single file: one object,
uploaded whole on close), is what makes it a step. Listing counts a step only when its
manifest is there, on every store.

:func:`commits_by_file` decides, from ``FOP_COMMIT`` (``auto``, the default: detect;
``file``: always a file written last; ``rename``: always a rename) and, for ``auto``,
the type of the mount holding the path (:func:`mount_type`, from
``/proc/self/mountinfo``: ``fuse``, ``fuse.<name>`` or ``fuseblk`` is FUSE). Where the
mount table cannot be read (not Linux), ``auto`` renames.

Pure reads of the mount table, on any thread, at each call (a mount can change while a
process runs; one small read per save).
"""

from __future__ import annotations

import os

from .._base import env as _env

__all__ = ["commits_by_file", "is_fuse", "mount_type", "mount_type_in"]

MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_type_in(path: str, mountinfo: str) -> str | None:
    """The filesystem type of the mount holding absolute ``path``, by the longest mount
    point that contains it in ``mountinfo`` (the text of a ``/proc/<pid>/mountinfo``);
    None when no line parses."""
    best, kind = -1, None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if " - " not in line or len(fields) < 5:
            continue
        point = _unescape(fields[4])
        fstype = line.split(" - ", 1)[1].split(" ", 1)[0]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # a later mount over the same point wins
            best, kind = len(point), fstype
    return kind


def mount_type(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (its nearest existing
    ancestor, links resolved as the kernel would), or None where the mount table cannot
    be read."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            table = f.read()
    except OSError:
        return None
    return mount_type_in(os.path.realpath(here), table)


def is_fuse(fstype: str | None) -> bool:
    return fstype is not None and (fstype in ("fuse", "fuseblk") or fstype.startswith("fuse."))


def commits_by_file(path: str) -> bool:
    """Whether a commit at local ``path`` writes a file last in place of a directory
    rename (``FOP_COMMIT``; ``auto``: on a FUSE mount, see the module docstring)."""
    how = _env.read("FOP_COMMIT")
    if how != "auto":
        return how == "file"
    return is_fuse(mount_type(path))
