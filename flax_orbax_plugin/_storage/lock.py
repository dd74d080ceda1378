"""One live writer per checkpoint directory.

``DirectoryLock`` takes an exclusive ``fcntl.flock`` on ``<directory>/.writer.lock``.
The kernel drops a flock when the holding process dies, however it dies
(SIGKILL included), so a crashed writer never leaves the directory stuck. The
holder's pid and host are written into the file only to make the error message
useful; they are never trusted. flock locks an open file description, so a
second lock in the same process is refused too. Local filesystems only.

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file: a symlink
(or FIFO, device...) named ``.writer.lock`` is refused with ForeignEntryError, and
what it points to is never truncated or written.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat

from .._errors import DirectoryLockedError, ForeignEntryError

__all__ = ["DirectoryLock", "DirectoryLockedError", "LOCK_FILE"]

LOCK_FILE = ".writer.lock"


class DirectoryLock:
    """Exclusive writer lock. ``acquire`` then ``release``; both on one thread."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except IsADirectoryError:
            raise ForeignEntryError(
                f"{self.path}: expected the writer lock file, found a directory; remove it "
                "to write to this directory"
            ) from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise ForeignEntryError(
                f"{self.path}: expected the writer lock file, found a symbolic link; it is "
                "never followed: remove the link to write to this directory"
            ) from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise ForeignEntryError(
                f"{self.path}: expected the writer lock file (a regular file), found "
                f"{'a FIFO' if stat.S_ISFIFO(mode) else 'a special file'}; remove it to write "
                "to this directory"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise DirectoryLockedError(
                f"{os.path.dirname(self.path)} already has a live writer ({holder}); "
                "open it with read_only=True to read while it trains"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None
