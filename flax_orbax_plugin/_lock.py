"""One live writer per checkpoint directory.

``DirectoryLock`` takes an exclusive ``fcntl.flock`` on ``<directory>/.writer.lock``.
The kernel drops a flock when the holding process dies, however it dies
(SIGKILL included), so a crashed writer never leaves the directory stuck. The
holder's pid and host are written into the file only to make the error message
useful; they are never trusted. flock locks an open file description, so a
second lock in the same process is refused too. Local filesystems only.
"""

from __future__ import annotations

import fcntl
import os
import socket

from ._errors import DirectoryLockedError

__all__ = ["DirectoryLock", "DirectoryLockedError", "LOCK_FILE"]

LOCK_FILE = ".writer.lock"


class DirectoryLock:
    """Exclusive writer lock. ``acquire`` then ``release``; both on one thread."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
