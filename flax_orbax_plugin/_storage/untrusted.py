"""Untrusted local files: the one opener every foreign-format reader uses.

:func:`open_regular` opens with ``O_NONBLOCK`` (a FIFO never blocks), optionally
``O_NOFOLLOW``, and refuses anything that is not a regular file with a
:class:`ForeignEntryError` naming the path and what was found; :func:`read_capped`
reads such a file whole, at most a cap of bytes, checked against ``fstat`` before
anything is allocated; :func:`loads_json` parses untrusted JSON; :func:`entry_kind`
names what a refused entry is (every refusal of a foreign entry says it so).

Thread-safety: every function here is safe to call from any thread.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

from .._errors import CheckpointNotFoundError, CorruptCheckpointError, ForeignEntryError


def entry_kind(mode: int) -> str:
    """'a FIFO', 'a symbolic link', 'a directory' ... for an ``st_mode``."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


# Largest JSON document (an index, a header, Orbax metadata) read into memory.
MAX_JSON_BYTES = 64 << 20


def open_regular(path: str, *, follow_links: bool, what: str) -> tuple[int, os.stat_result]:
    """``(fd, fstat)`` of a regular file opened read-only, never blocking.

    ``follow_links``: the path itself may be a symlink (it must resolve to a regular
    file); otherwise a symlink is refused. Directories on the way are resolved by
    the OS as usual (the caller names them). Raises CheckpointNotFoundError when
    nothing is there and ForeignEntryError for a link (when not followed), a FIFO,
    a device, a socket or a directory; ``what`` names the file's role in messages
    ("safetensors file", "msgpack checkpoint").
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow_links:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such {what}") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            try:
                found = entry_kind(os.lstat(path).st_mode)
            except OSError:
                found = "something that cannot be opened"
            raise ForeignEntryError(
                f"{path}: expected a {what} (a regular file), found {found} (not read)"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ForeignEntryError(
                f"{path}: expected a {what} (a regular file), found {entry_kind(st.st_mode)} "
                f"(not read)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_capped(path: str, *, follow_links: bool, what: str, max_bytes: int) -> bytes:
    """The whole of a regular file (see :func:`open_regular`), refused above
    ``max_bytes`` (checked against ``fstat`` first, then while reading: a file that
    grows is noticed)."""
    fd, st = open_regular(path, follow_links=follow_links, what=what)
    try:
        if st.st_size > max_bytes:
            raise CorruptCheckpointError(
                f"{path}: expected a {what} of at most {max_bytes} bytes, found {st.st_size}"
            )
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 24, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise CorruptCheckpointError(
                    f"{path}: expected a {what} of at most {max_bytes} bytes; it grew past that"
                )
        return b"".join(chunks)
    finally:
        os.close(fd)


def loads_json(raw: bytes, where: str) -> Any:
    """Parses untrusted JSON; CorruptCheckpointError naming ``where`` for bad UTF-8,
    bad JSON or nesting too deep for the parser (never a RecursionError)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: JSON nested too deeply to read") from None
