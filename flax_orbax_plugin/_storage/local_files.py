"""Local files under a location, never following a link below it.

The location's own path is taken as given (it may pass through a symlink the user
chose), but every name below it is opened component by component with
``O_NOFOLLOW`` (:func:`open_dirs`); only regular files are read (a FIFO, a device or a
symlink is a :class:`ForeignEntryError` naming it, never a hang), small files are
capped at :data:`MAX_SMALL_FILE_BYTES`, and files are written under a temporary name,
then renamed. Plain functions of paths, safe from any thread; :class:`.location.Location`
is their one caller besides the walks (:func:`walk_entries`) and :func:`entry_kind`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator

from .._base import env as _env
from .._errors import CorruptCheckpointError, ForeignEntryError
from .json_docs import MAX_DOCUMENT_BYTES

# Largest small file (JSON metadata, manifest, JSON items, markers) read into memory.
MAX_SMALL_FILE_BYTES = MAX_DOCUMENT_BYTES


def walk_entries(top: str):
    """Every entry under the local directory ``top`` that is not a directory (files,
    links, FIFOs ...), walked without following any link, opening no file; nothing
    when ``top`` is missing."""
    stack = [top]
    while stack:
        where = stack.pop()
        try:
            it = os.scandir(where)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    yield entry


def _kind(st: os.stat_result) -> str:
    return entry_kind(st.st_mode)


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


def require_regular(st: os.stat_result, path: str, *, allow_dir: bool = False) -> None:
    if stat.S_ISREG(st.st_mode) or (allow_dir and stat.S_ISDIR(st.st_mode)):
        return
    raise ForeignEntryError(
        f"{path}: expected a regular file written by this library, found {_kind(st)} "
        "(never followed or read)"
    )


def check_size(size: int, path: str, max_bytes: int | None = MAX_SMALL_FILE_BYTES) -> None:
    if max_bytes is not None and size > max_bytes:
        raise CorruptCheckpointError(
            f"{path}: expected a small file of at most {max_bytes} bytes, found {size} bytes"
        )


def open_dirs(root: str, parts: list[str], *, create: bool = False) -> int:
    """An fd of ``root/parts...``: ``root`` as given, each part opened with
    ``O_NOFOLLOW`` (created first with ``create``). ForeignEntryError for a symlink
    or non-directory on the way; FileNotFoundError when a part is missing."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walked = root.rstrip("/")
        for part in parts:
            walked += "/" + part
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                sub = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):  # named by its whole path
                    raise type(e)(e.errno, e.strerror, walked) from None
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                raise ForeignEntryError(
                    f"{walked}: expected a directory written by this library, found {_kind(st)} "
                    "(never followed)"
                ) from None
            os.close(fd)
            fd = sub
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_regular(root: str, name: str) -> tuple[int, os.stat_result] | None:
    """An fd of the regular file ``root/name`` (never through a link, a FIFO never
    waited on) and its stat; None when it does not exist."""
    parts = name.split("/")
    path = os.path.join(root, name)
    try:
        dfd = open_dirs(root, parts[:-1])
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(parts[-1], flags, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:  # named by its whole path, not its last part
            raise type(e)(e.errno, e.strerror, path) from None
        require_regular(os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False), path)
        raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        require_regular(st, path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file(root: str, name: str, max_bytes: int | None) -> bytes | None:
    path = os.path.join(root, name)
    opened = _open_regular(root, name)
    if opened is None:
        return None
    fd, st = opened
    try:
        check_size(st.st_size, path, max_bytes)
        chunks, total = [], 0
        while True:  # the file may grow after fstat: read at most the cap (+1 to notice)
            want = 1 << 24 if max_bytes is None else min(1 << 24, max_bytes + 1 - total)
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            check_size(total, path, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_pieces(root: str, name: str, piece: int) -> Iterator[bytes] | None:
    """The file ``root/name`` as pieces of at most ``piece`` bytes, read as they are
    taken (a generator: one piece held at a time), never through a link; None when it
    does not exist. The file is closed when the generator ends or is closed."""
    opened = _open_regular(root, name)
    if opened is None:
        return None
    fd = opened[0]

    def pieces() -> Iterator[bytes]:
        try:
            while chunk := os.read(fd, piece):
                yield chunk
        finally:
            os.close(fd)

    return pieces()


def write_file(
    root: str, name: str, data: bytes | Iterable[bytes], *, durable: bool = True
) -> None:
    """Writes ``root/name`` whole (a temporary name, then a rename), never through a
    link; an OSError names the file it was writing (EFBIG, ENOSPC, EACCES ...).
    ``data``: the bytes, or an iterable of pieces written as each is taken."""
    _env.fail_point("write_small")
    try:
        _write_file(root, name, data, durable=durable)
    except OSError as e:
        if e.errno is None:
            raise
        where = os.path.join(root, name)
        text = f"writing {where} failed: {e.strerror}"
        other = e.filename if isinstance(e.filename, str) and os.path.isabs(e.filename) else None
        if other is None or other == where:
            raise OSError(e.errno, text) from e
        raise OSError(e.errno, text, other) from e  # where on the way it failed


def make_dirs(root: str) -> None:
    """``os.makedirs(root, exist_ok=True)``; a file (or another non-directory) where a
    directory on the way must be is a ForeignEntryError naming it, left alone."""
    try:
        os.makedirs(root, exist_ok=True)
    except (NotADirectoryError, FileExistsError):
        walked = os.path.abspath(root)
        while not os.path.lexists(walked) or os.path.isdir(walked):
            parent = os.path.dirname(walked)
            if parent == walked:
                raise
            walked = parent
        st = os.stat(walked, follow_symlinks=False)
        raise ForeignEntryError(
            f"cannot create the directory {os.path.abspath(root)}: {walked} is "
            f"{_kind(st)}, not a directory; it is left alone. Choose another path"
        ) from None


def _write_file(root: str, name: str, data: bytes | Iterable[bytes], *, durable: bool) -> None:
    parts = name.split("/")
    make_dirs(root)
    dfd = open_dirs(root, parts[:-1], create=True)
    try:
        tmp = f"{parts[-1]}.tmp-{secrets.token_hex(8)}"  # unpredictable, created exclusively
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=dfd,
            )
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise ForeignEntryError(
                f"{os.path.join(root, tmp)}: expected a file written by this library, "
                "found a symbolic link (never followed)"
            ) from None
        try:
            try:
                for piece in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(fd, view) :]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a link itself
        except BaseException:
            try:  # ENOSPC, EIO ...: no half-written temporary file stays behind
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)


def delete_file(root: str, name: str) -> None:
    """Unlinks ``root/name`` (a symlink itself, never its target); no error if absent."""
    parts = name.split("/")
    try:
        dfd = open_dirs(root, parts[:-1])
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        os.unlink(parts[-1], dir_fd=dfd)  # a symlink itself, never its target
    except FileNotFoundError:
        pass
    finally:
        os.close(dfd)


def exists(root: str, name: str) -> bool:
    """True for a regular file or directory at ``root/name``; ForeignEntryError for a
    symlink or special file there (or on the way there)."""
    parts = name.split("/")
    try:
        dfd = open_dirs(root, parts[:-1])
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)
    require_regular(st, os.path.join(root, name), allow_dir=True)
    return True


def child_kinds(path: str) -> dict[str, str]:
    """``{name: "dir" | "file" | "symlink" | "other"}`` of the immediate children, from
    the directory entries themselves (no symlink is followed)."""
    out = {}
    try:
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_symlink():
                    out[entry.name] = "symlink"
                elif entry.is_dir(follow_symlinks=False):
                    out[entry.name] = "dir"
                elif entry.is_file(follow_symlinks=False):
                    out[entry.name] = "file"
                else:
                    out[entry.name] = "other"
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return dict(sorted(out.items()))


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
            f"found {_kind(st)} (nothing was removed)"
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


def exchange(a_path: str, b_path: str) -> bool:
    """Atomically swaps two directories (``renameat2(RENAME_EXCHANGE)``), then fsyncs
    ``b_path``'s parent; False where the kernel or filesystem cannot."""
    a, b = a_path.encode(), b_path.encode()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, a, at_fdcwd, b, rename_exchange) != 0:
        return False
    fsync_dir(os.path.dirname(b_path))
    return True


def sync_tree(path: str) -> None:
    """Makes everything under the directory ``path`` durable: one ``syncfs``, else an
    fsync of every file (links skipped) and directory."""
    if _syncfs(path):
        return
    for root, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # a symlink: not ours, nothing to sync
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def _syncfs(path: str) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syncfs = libc.syncfs
    except (OSError, AttributeError):
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return syncfs(fd) == 0
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
