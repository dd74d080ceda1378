"""Local entries that may not be what they seem, never followed through a link: the one
opener every foreign-format reader uses (:func:`open_regular`: ``O_NONBLOCK``, so a FIFO
never blocks; anything but a regular file is a :class:`ForeignEntryError`), a capped
whole read, untrusted JSON and where in it a refusal of ``local_files`` points, what a
refused entry is (:func:`entry_kind`), and a local directory as a whole (size, newest
change, removal), walked with ``lstat``.

Pure functions of paths: any thread.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from typing import Any

from .._errors import CheckpointNotFoundError, CorruptCheckpointError, ForeignEntryError

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
    (stat.S_ISSOCK, "a socket"),
)


def entry_kind(mode: int) -> str:
    """'a FIFO', 'a symbolic link', 'a directory' ... for an ``st_mode``."""
    return next((kind for test, kind in _KINDS if test(mode)), "a special file")


def open_regular(path: str, *, follow_links: bool, what: str) -> tuple[int, os.stat_result]:
    """``(fd, fstat)`` of a regular file opened read-only, never blocking (a symlink at
    the path only with ``follow_links``). CheckpointNotFoundError when nothing is there,
    ForeignEntryError for anything but a regular file; ``what`` names the file's role
    in messages ("safetensors file")."""
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
    """The whole of a regular file (:func:`open_regular`), refused above ``max_bytes``
    (by ``fstat`` first, then while reading)."""
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


_KEY_BEFORE = re.compile(rb'"([^"\\]{1,64})"\s*:\s*[\[\s]*$')


def field_before(raw: bytes, text: str) -> str:
    """The key under which the number ``text`` first appears in ``raw`` (for the error
    message), else its byte offset."""
    at = raw.find(text.encode())
    if at < 0:
        return "?"
    match = _KEY_BEFORE.search(raw[max(0, at - 200) : at])
    return match.group(1).decode(errors="replace") if match else f"at byte {at}"


def unencodable(value: Any) -> tuple[str, str] | None:
    """(where in ``value``, the text) of the first str (key or value) that UTF-8 cannot
    encode (a lone surrogate), or None. Walked without recursion."""
    stack: list[tuple[Any, str]] = [(value, "the value")]
    while stack:
        x, at = stack.pop()
        if isinstance(x, str):
            if not _encodes(x):
                return at, _shown(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                if isinstance(k, str) and not _encodes(k):
                    return f"the key {_shown(k)!r} of {at}", _shown(k)
                stack.append((v, f"{at}[{k!r}]"[:200]))
        elif isinstance(x, list | tuple):
            stack.extend((v, f"{at}[{i}]"[:200]) for i, v in enumerate(x))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."
