"""One live writer per checkpoint directory: an exclusive ``flock`` on ``.writer.lock``.

Local filesystems only; a second lock in the same process is refused.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.lock``.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import os
import socket
import stat

from .._errors import DirectoryLockedError, ForeignEntryError

__all__ = ["DirectoryLock", "DirectoryLockedError", "LOCK_FILE"]

LOCK_FILE = ".writer.lock"
logger = logging.getLogger("flax_orbax_plugin")


class DirectoryLock:
    """Exclusive writer lock. ``acquire`` then ``release``; both on one thread."""

    def __init__(self, directory: str, *, made_directory: bool = False):
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None
        self._lost = False  # taken, then found removed and not taken again (yet)
        self._created = False  # acquire created the lock file (O_EXCL), not found it
        self._made_directory = made_directory  # the writer's open made the directory

    def acquire(self, *, collected: bool = False) -> None:
        fd = self._open()
        try:
            self._check_own_file(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = _holder_in(fd)
            finally:
                os.close(fd)
            ours = holder == _holder_text()  # this process: a manager not closed
            if ours and not collected:  # one nobody holds any more (a notebook cell run
                gc.collect()  # again) lets go when it is collected
                return self.acquire(collected=True)
            mine = ": this process; close() its CheckpointManager (or callback) first"
            raise DirectoryLockedError(
                f"{os.path.dirname(self.path)} already has a live writer ({holder}"
                f"{mine if ours else ''}); open it with read_only=True to read while it trains"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        if not self._at_path(fd):  # a refused open discarded that file meanwhile: again
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return self.acquire(collected=collected)
        try:  # checked again under the lock: a link made meanwhile is never written
            self._check_own_file(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, _holder_text().encode(), 0)
        except BaseException as e:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            if isinstance(e, OSError) and e.errno is not None and not e.filename:
                raise OSError(e.errno, f"writing {self.path} failed: {e.strerror}") from e
            raise
        self._fd = fd

    def _open(self) -> int:
        """The lock file created exclusively, else the one in place (left by an earlier
        writer) opened without following a link."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        for _ in range(3):  # an existing file removed between the two opens: again
            self._created = False
            try:  # (O_EXCL: a directory or link there is EEXIST too, refused below)
                fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pass
            else:
                self._created = True
                return fd
            try:
                return os.open(self.path, flags)
            except FileNotFoundError:
                continue
            except IsADirectoryError:
                raise self._foreign("a directory") from None
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise self._foreign("a symbolic link (it is never followed)") from None
        raise DirectoryLockedError(f"{self.path}: created and removed again while opened")

    def _check_own_file(self, fd: int) -> None:
        """ForeignEntryError (the caller closes ``fd``) for a lock file that is no regular
        file or has another name (a hard link: writing it would write the file it links)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise self._foreign("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a special file")
        if st.st_nlink != 1:
            raise self._foreign(
                f"a file with {st.st_nlink} names (a hard link of another file; it is "
                "never written)"
            )

    def _foreign(self, found: str) -> ForeignEntryError:
        return ForeignEntryError(
            f"{self.path}: expected the writer lock file (a regular file with one name), "
            f"found {found}; remove it to write to this directory"
        )

    def release(self) -> None:
        self._lost = False
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def discard(self) -> None:
        """:meth:`release` for a writer's open refused after the lock was taken: the lock
        file goes too where this lock created it (unlinked while held: :meth:`acquire`
        checks the file it holds is still at the path), and the directory where the open
        made it and it is empty."""
        if self._fd is not None and self._created and self._at_path(self._fd):
            try:
                os.unlink(self.path)
            except OSError as e:  # left as any closed writer leaves it: harmless
                logger.debug("checkpoint: could not remove %s: %s", self.path, e)
        self.release()
        if self._made_directory:
            try:
                os.rmdir(os.path.dirname(self.path))  # refused unless empty: nothing lost
            except OSError:
                pass

    def _at_path(self, fd: int) -> bool:
        """Whether ``fd`` is the file at :attr:`path` now (not one removed meanwhile)."""
        held = os.fstat(fd)
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def before_commit(self) -> None:
        """A writer's check right before it commits a step: nothing to do (the kernel
        holds a ``flock`` for its process; the writer checks the file before each save)."""

    def take_again_if_lost(self) -> bool:
        """Whether the lock file this writer holds was no longer the one at its path (the
        directory removed, or the file replaced) and was taken again, with a WARNING (a
        write would otherwise recreate the directory unlocked); DirectoryLockedError when
        another writer holds the new one. The writer calls it before each write."""
        if self._fd is None and not self._lost:
            return False  # never taken, or released
        if self._fd is not None:
            if self._at_path(self._fd):
                return False
            self.release()
            self._lost = True  # until taken again: every later write tries, or is refused
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.acquire()
        self._lost = False
        logger.warning(
            "checkpoint: the lock file %s was removed or replaced while its writer was open "
            "(the directory deleted?); the writer holds it again, and writes on",
            self.path,
        )
        return True


def live_holder(directory: str) -> str | None:
    """Who holds the writer lock of the local ``directory`` now (what its file says), or
    None. Reads only: a shared lock is taken and let go at once; a lock file that is a
    link or no regular file is nobody's."""
    path = os.path.join(directory, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _holder_in(fd)
    finally:
        os.close(fd)


def _holder_in(fd: int) -> str:
    """What the lock file open at ``fd`` says of its holder (for messages only)."""
    return os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"


def _holder_text() -> str:
    """What the lock file says of its holder (for messages only, never trusted)."""
    return f"pid {os.getpid()} on {socket.gethostname()}"
