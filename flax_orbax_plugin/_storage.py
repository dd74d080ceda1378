"""Storage layer: where a checkpoint lives, on any tensorstore kvstore.

A :class:`Location` is a directory-like prefix on a store: the local filesystem
(the default), ``s3://``, ``gs://``, ``memory://`` or any tensorstore kvstore
spec given as a dict. Array data is read and written by tensorstore drivers
pointed at :meth:`Location.kvstore`; the small JSON files (metadata, commit
marker) and listing/removal go through this module.

Local directories support atomic rename; object stores do not, so callers
commit there by writing a marker last (see ``_commit``).

Thread-safety: a Location is immutable; its methods may be called from any
thread. The shared tensorstore context is created once, lazily. Tensorstore does not
fsync what it writes; callers make a location durable with :meth:`Location.sync`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import threading
from typing import Any
from urllib.parse import urlparse

import tensorstore as ts

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


def _check_name(name: str) -> str:
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
        return self._with_path(self.path + _check_name(name) + "/")

    def sibling(self, name: str) -> Location:
        parent = self.path.rstrip("/").rsplit("/", 1)[0] if "/" in self.path.rstrip("/") else ""
        prefix = parent + "/" if parent or self.is_local else ""
        return self._with_path(prefix + _check_name(name) + "/")

    @property
    def parent(self) -> Location:
        parent = self.path.rstrip("/").rsplit("/", 1)[0] if "/" in self.path.rstrip("/") else ""
        return self._with_path(parent + "/" if parent else ("/" if self.is_local else ""))

    # -- tensorstore --------------------------------------------------------------

    def kvstore(self, sub: str = "") -> dict[str, Any]:
        """The kvstore spec for ``sub`` (a relative directory) under this location."""
        spec = self.spec
        if sub:
            spec["path"] = self.path + _check_name(sub) + "/"
        return spec

    def _kv(self) -> ts.KvStore:
        return ts.KvStore.open(self.spec, context=context(local=self.is_local)).result()

    # -- small files ---------------------------------------------------------------

    def local_file(self, name: str) -> str:
        return os.path.join(self.path, _check_name(name))

    def read_bytes(self, name: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        if self.is_local:
            try:
                with open(self.local_file(name), "rb") as f:
                    return f.read()
            except (FileNotFoundError, NotADirectoryError):
                return None
        result = self._kv().read(_check_name(name)).result()
        return result.value if result.state == "value" else None

    def write_bytes(self, name: str, data: bytes, *, durable: bool = True) -> None:
        """Writes the file whole (a temporary name, then a rename on local disk); with
        ``durable``, fsyncs the file and its directory (else a later :meth:`sync` does)."""
        if self.is_local:
            final = self.local_file(name)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = final + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if durable:
                fsync_dir(os.path.dirname(final))
            return
        self._kv().write(_check_name(name), data).result()

    def read_json(self, name: str) -> Any | None:
        data = self.read_bytes(name)
        return None if data is None else json.loads(data.decode("utf-8"))

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"))

    def delete(self, name: str) -> None:
        """Deletes one file (no error if it is absent)."""
        if self.is_local:
            try:
                os.remove(self.local_file(name))
            except FileNotFoundError:
                pass
            return
        key = _check_name(name)
        only_key = ts.KvStore.KeyRange(inclusive_min=key, exclusive_max=key + "\0")
        self._kv().delete_range(only_key).result()

    def exists(self, name: str) -> bool:
        if self.is_local:
            return os.path.exists(self.local_file(name))
        return self.read_bytes(name) is not None

    # -- directories ---------------------------------------------------------------

    def is_dir(self) -> bool:
        """True when anything at all is stored under this location."""
        if self.is_local:
            return os.path.isdir(self.path)
        return bool(self._kv().list(range=_prefix_range(""), strip_prefix_length=0).result()[:1])

    def list_children(self) -> list[str]:
        """Names of the immediate children (files and directories), sorted."""
        if self.is_local:
            try:
                return sorted(os.listdir(self.path))
            except FileNotFoundError:
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
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
        return total

    def makedirs(self) -> None:
        """Creates a local directory (and its parents); nothing to do on object stores."""
        if self.is_local:
            os.makedirs(self.path, exist_ok=True)

    def remove(self) -> None:
        """Removes everything under this location (no error if nothing is there)."""
        if self.is_local:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        self._kv().delete_range(_prefix_range("")).result()

    def rename(self, dst: Location) -> None:
        """Atomic rename of a local directory, then fsync of the parent."""
        if not (self.is_local and dst.is_local):
            raise NotImplementedError("rename is only supported on the local filesystem")
        os.rename(self.path.rstrip("/"), dst.path.rstrip("/"))
        fsync_dir(os.path.dirname(dst.path.rstrip("/")))

    def sync(self) -> None:
        """Makes everything written under a local location durable (no-op elsewhere:
        an object store's write is durable once acknowledged).

        One ``syncfs`` of the filesystem costs about one fsync of a single large file,
        while an fsync per file costs a disk flush each; where ``syncfs`` is missing,
        every file and directory is fsynced.
        """
        if not self.is_local or not os.path.isdir(self.path):
            return  # nothing written here by this process (e.g. a replica that wrote nothing)
        if _syncfs(self.path):
            return
        for root, _, files in os.walk(self.path):
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
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
