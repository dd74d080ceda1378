"""Storage layer: where a checkpoint lives, on any tensorstore kvstore.

A :class:`Location` is a directory-like prefix on a store: the local filesystem
(the default), ``s3://``, ``gs://``, ``memory://`` or any tensorstore kvstore
spec given as a dict. Array data is read and written by tensorstore drivers
pointed at :meth:`Location.kvstore`; the small JSON files (metadata, commit
marker) and listing/removal go through this module.

Local directories support atomic rename; object stores do not, so callers
commit there by writing a marker last (see ``_commit``).

Local files: the location's own path is taken as given (it may pass through a
symlink the user chose), but nothing *under* it is ever followed: every name below
the location is opened component by component with ``O_NOFOLLOW``; only regular
files are read (a FIFO, a device or a symlink is a :class:`ForeignEntryError` naming
it, never a hang), and small files are capped at :data:`MAX_SMALL_FILE_BYTES`.
:meth:`Location.remove` refuses a location that is itself a symlink.

Thread-safety: a Location is immutable; its methods may be called from any
thread. The shared tensorstore context is created once, lazily. Tensorstore does not
fsync what it writes; callers make a location durable with :meth:`Location.sync`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import secrets
import shutil
import stat
import threading
from typing import Any
from urllib.parse import urlparse

import tensorstore as ts

from .._base import faults as _faults
from .._errors import CorruptCheckpointError, ForeignEntryError

# Largest small file (JSON metadata, manifest, JSON items, markers) read into memory.
MAX_SMALL_FILE_BYTES = 64 << 20

_CONTEXTS: dict[bool, ts.Context] = {}
_CONTEXT_LOCK = threading.Lock()


def context(*, local: bool = True) -> ts.Context:
    """The tensorstore context shared by every open: caches off, no fsync by tensorstore
    (see :meth:`Location.sync`). Local disks get few concurrent file operations (more
    only raised peak memory on restore, measured here), object stores many (latency).
    """
    with _CONTEXT_LOCK:
        if local not in _CONTEXTS:
            spec: dict[str, Any] = {
                "cache_pool": {"total_bytes_limit": 0},
                "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
            }
            if local:
                spec["file_io_sync"] = False
                spec["file_io_concurrency"] = {"limit": 8}
            else:
                spec["s3_request_concurrency"] = {"limit": 32}
                spec["gcs_request_concurrency"] = {"limit": 32}
            _CONTEXTS[local] = ts.Context(spec)
        return _CONTEXTS[local]


def check_name(name: str) -> str:
    """``name`` if it is a relative storage name inside a location (no empty, ``.`` or
    ``..`` component, no backslash or NUL); ValueError otherwise."""
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
        raise ValueError(f"invalid storage name {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class Location:
    """A directory on a store. ``spec`` is a tensorstore kvstore spec whose path ends in '/'."""

    spec_json: str  # canonical JSON of the kvstore spec (hashable, immutable)

    @property
    def spec(self) -> dict[str, Any]:
        return json.loads(self.spec_json)

    @property
    def path(self) -> str:
        return self.spec.get("path", "")

    @property
    def is_local(self) -> bool:
        return self.spec["driver"] == "file"

    @property
    def supports_rename(self) -> bool:
        return self.is_local

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        spec = self.spec
        if spec["driver"] == "file":
            return spec["path"].rstrip("/")
        if spec["driver"] in ("s3", "gcs"):
            scheme = "s3" if spec["driver"] == "s3" else "gs"
            return f"{scheme}://{spec['bucket']}/{spec['path'].rstrip('/')}"
        return f"{spec['driver']}://{spec['path'].rstrip('/')}"

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_path(cls, path: Any) -> Location:
        """Accepts a Location, os.PathLike/str path, an s3/gs/memory/file URL or a kvstore dict."""
        if isinstance(path, Location):
            return path
        if isinstance(path, dict):
            spec = dict(path)
            if "driver" not in spec:
                raise ValueError(f"kvstore spec needs a 'driver': {path!r}")
            if spec["driver"] == "file":
                spec["path"] = os.path.abspath(spec.get("path", "."))
        else:
            text = os.fspath(path)
            url = urlparse(text)
            if url.scheme in ("s3", "gs"):
                spec = {
                    "driver": "s3" if url.scheme == "s3" else "gcs",
                    "bucket": url.netloc,
                    "path": url.path.lstrip("/"),
                }
                if url.scheme == "s3":
                    spec.update(_s3_settings_from_env())
            elif url.scheme == "memory":
                spec = {"driver": "memory", "path": (url.netloc + url.path).lstrip("/")}
            elif url.scheme == "file":
                spec = {"driver": "file", "path": os.path.abspath(url.path)}
            elif url.scheme in ("",) or len(url.scheme) == 1:  # plain or Windows-like path
                spec = {"driver": "file", "path": os.path.abspath(text)}
            else:
                raise ValueError(f"unsupported checkpoint location {text!r}")
        spec["path"] = spec.get("path", "").rstrip("/") + "/"
        if spec["driver"] != "file" and spec["path"] == "/":
            spec["path"] = ""
        return cls(json.dumps(spec, sort_keys=True))

    def _with_path(self, path: str) -> Location:
        spec = self.spec
        spec["path"] = path
        return Location(json.dumps(spec, sort_keys=True))

    def child(self, name: str) -> Location:
        return self._with_path(self.path + check_name(name) + "/")

    def sibling(self, name: str) -> Location:
        parent = self.path.rstrip("/").rsplit("/", 1)[0] if "/" in self.path.rstrip("/") else ""
        prefix = parent + "/" if parent or self.is_local else ""
        return self._with_path(prefix + check_name(name) + "/")

    @property
    def parent(self) -> Location:
        parent = self.path.rstrip("/").rsplit("/", 1)[0] if "/" in self.path.rstrip("/") else ""
        return self._with_path(parent + "/" if parent else ("/" if self.is_local else ""))

    # -- tensorstore --------------------------------------------------------------

    def kvstore(self, sub: str = "") -> dict[str, Any]:
        """The kvstore spec for ``sub`` (a relative directory) under this location."""
        spec = self.spec
        if sub:
            spec["path"] = self.path + check_name(sub) + "/"
        return spec

    def _kv(self) -> ts.KvStore:
        return ts.KvStore.open(self.spec, context=context(local=self.is_local)).result()

    # -- small files ---------------------------------------------------------------

    def read_bytes(
        self, name: str, *, max_bytes: int | None = MAX_SMALL_FILE_BYTES
    ) -> bytes | None:
        """The file's bytes, or None when it does not exist.

        Raises ForeignEntryError for a symlink or non-regular file (never followed or
        read) and CorruptCheckpointError above ``max_bytes`` (metadata and JSON files:
        :data:`MAX_SMALL_FILE_BYTES`; None for array data copied whole).
        """
        if self.is_local:
            return _read_local(self.path, check_name(name), max_bytes)
        result = self._kv().read(check_name(name)).result()
        if result.state != "value":
            return None
        _check_size(len(result.value), f"{self}/{name}", max_bytes)
        return result.value

    def write_bytes(self, name: str, data: bytes, *, durable: bool = True) -> None:
        """Writes the file whole (a temporary name, then a rename on local disk); with
        ``durable``, fsyncs the file and its directory (else a later :meth:`sync` does)."""
        if self.is_local:
            _write_local(self.path, check_name(name), data, durable=durable)
            return
        self._kv().write(check_name(name), data).result()

    def delete(self, name: str) -> None:
        """Deletes one file (no error if it is absent)."""
        if self.is_local:
            parts = check_name(name).split("/")
            try:
                dfd = _open_dirs(self.path, parts[:-1])
            except (FileNotFoundError, NotADirectoryError):
                return
            try:
                os.unlink(parts[-1], dir_fd=dfd)  # a symlink itself, never its target
            except FileNotFoundError:
                pass
            finally:
                os.close(dfd)
            return
        key = check_name(name)
        only_key = ts.KvStore.KeyRange(inclusive_min=key, exclusive_max=key + "\0")
        self._kv().delete_range(only_key).result()

    def exists(self, name: str) -> bool:
        """True for a regular file or directory at ``name``; ForeignEntryError for a
        symlink or special file there (or on the way there)."""
        if self.is_local:
            parts = check_name(name).split("/")
            try:
                dfd = _open_dirs(self.path, parts[:-1])
            except (FileNotFoundError, NotADirectoryError):
                return False
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            finally:
                os.close(dfd)
            _require_regular(st, os.path.join(self.path, name), allow_dir=True)
            return True
        return self.read_bytes(name) is not None

    # -- directories ---------------------------------------------------------------

    def is_dir(self) -> bool:
        """True when anything at all is stored under this location."""
        if self.is_local:
            return os.path.isdir(self.path)
        return bool(self._kv().list(range=_prefix_range(""), strip_prefix_length=0).result()[:1])

    def child_kinds(self) -> dict[str, str]:
        """Local only: ``{name: "dir" | "file" | "symlink" | "other"}`` of the immediate
        children, from the directory entries themselves (no symlink is followed)."""
        if not self.is_local:
            raise NotImplementedError(f"entry kinds are only listed on local disks, not {self}")
        out = {}
        try:
            with os.scandir(self.path) as it:
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

    def check_no_links(self) -> None:
        """Local only (no-op elsewhere): raises ForeignEntryError naming the first
        symlink or special file anywhere under this location. One ``scandir`` walk,
        no file opened; restore calls it once per checkpoint, since tensorstore's
        file driver follows symlinks."""
        if not self.is_local:
            return
        for entry in walk_entries(self.path.rstrip("/") or "/"):
            if not entry.is_file(follow_symlinks=False):
                _require_regular(entry.stat(follow_symlinks=False), entry.path)

    def list_children(self) -> list[str]:
        """Names of the immediate children (files and directories), sorted."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path))
            except (FileNotFoundError, NotADirectoryError):
                return []
        keys = self._kv().list().result()
        names = {k.decode("utf-8").split("/", 1)[0] for k in keys}
        return sorted(n for n in names if n)

    def size_bytes(self) -> int:
        """Total bytes of the files under a local location."""
        if not self.is_local:
            raise NotImplementedError(f"sizes are only listed on local disks, not {self}")
        total = 0
        for root, _, files in os.walk(self.path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except OSError:
                    pass
        return total

    def makedirs(self) -> None:
        """Creates a local directory (and its parents); nothing to do on object stores."""
        if self.is_local:
            os.makedirs(self.path, exist_ok=True)

    def remove(self) -> None:
        """Removes everything under this location (no error if nothing is there).

        Proves nothing: the package removes only through ``_ownership`` (which proves
        a place ours first); this primitive is left for tests that clean up by hand.

        Local: only a real directory is removed; symlinks inside it are unlinked, never
        followed. A location that is itself a symlink or not a directory is refused
        with ForeignEntryError (what it points to is left alone).
        """
        if self.is_local:
            path = self.path.rstrip("/")  # a trailing '/' would make lstat follow a link
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
            return
        self._kv().delete_range(_prefix_range("")).result()

    def rename(self, dst: Location) -> None:
        """Atomic rename of a local directory, then fsync of the parent."""
        if not (self.is_local and dst.is_local):
            raise NotImplementedError("rename is only supported on the local filesystem")
        os.rename(self.path.rstrip("/"), dst.path.rstrip("/"))
        fsync_dir(os.path.dirname(dst.path.rstrip("/")))

    def newest_mtime(self) -> float:
        """Local only: the latest modification time of this directory and its immediate
        entries (``lstat``: no link followed); ``inf`` when it cannot be read."""
        path = self.path.rstrip("/")
        try:
            times = [os.lstat(path).st_mtime]
            with os.scandir(path) as it:
                times += [e.stat(follow_symlinks=False).st_mtime for e in it]
        except OSError:
            return float("inf")
        return max(times)

    def exchange(self, other: Location) -> bool:
        """Atomically swaps two local directories (``renameat2(RENAME_EXCHANGE)``), then
        fsyncs the parent; False where the kernel or filesystem cannot (the caller then
        renames in two steps)."""
        if not (self.is_local and other.is_local):
            return False
        a, b = self.path.rstrip("/").encode(), other.path.rstrip("/").encode()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            renameat2 = libc.renameat2
        except (OSError, AttributeError):
            return False
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, a, at_fdcwd, b, rename_exchange) != 0:
            return False
        fsync_dir(os.path.dirname(other.path.rstrip("/")))
        return True

    def sync(self) -> None:
        """Makes everything written under a local location durable (no-op elsewhere:
        an object store's write is durable once acknowledged).

        One ``syncfs`` of the filesystem costs about one fsync of a single large file,
        while an fsync per file costs a disk flush each; where ``syncfs`` is missing,
        every file and directory is fsynced.
        """
        if not self.is_local:
            return
        # A save with no array data writes nothing before its metadata: the staging
        # directory (which the commit renames) is created here.
        os.makedirs(self.path, exist_ok=True)
        if _syncfs(self.path):
            return
        for root, _, files in os.walk(self.path):
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


def _require_regular(st: os.stat_result, path: str, *, allow_dir: bool = False) -> None:
    if stat.S_ISREG(st.st_mode) or (allow_dir and stat.S_ISDIR(st.st_mode)):
        return
    raise ForeignEntryError(
        f"{path}: expected a regular file written by this library, found {_kind(st)} "
        "(never followed or read)"
    )


def _check_size(size: int, path: str, max_bytes: int | None = MAX_SMALL_FILE_BYTES) -> None:
    if max_bytes is not None and size > max_bytes:
        raise CorruptCheckpointError(
            f"{path}: expected a small file of at most {max_bytes} bytes, found {size} bytes"
        )


def _open_dirs(root: str, parts: list[str], *, create: bool = False) -> int:
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
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
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


def _read_local(root: str, name: str, max_bytes: int | None) -> bytes | None:
    parts = name.split("/")
    path = os.path.join(root, name)
    try:
        dfd = _open_dirs(root, parts[:-1])
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(parts[-1], flags, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        _require_regular(os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False), path)
        raise
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        _require_regular(st, path)
        _check_size(st.st_size, path, max_bytes)
        chunks, total = [], 0
        while True:  # the file may grow after fstat: read at most the cap (+1 to notice)
            want = 1 << 24 if max_bytes is None else min(1 << 24, max_bytes + 1 - total)
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            _check_size(total, path, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_local(root: str, name: str, data: bytes, *, durable: bool = True) -> None:
    _faults.fail_point("write_small")
    parts = name.split("/")
    os.makedirs(root, exist_ok=True)
    dfd = _open_dirs(root, parts[:-1], create=True)
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
                view = memoryview(data)
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


def _s3_settings_from_env() -> dict[str, str]:
    """S3-compatible servers: tensorstore's s3 driver ignores ``AWS_ENDPOINT_URL``
    (it always talks to amazonaws.com), so an ``s3://`` URL takes it from here."""
    settings = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        settings["aws_region"] = region
    return settings


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    if not prefix:
        return ts.KvStore.KeyRange()
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=end)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
