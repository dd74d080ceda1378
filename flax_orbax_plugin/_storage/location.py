"""Where a checkpoint lives: the kvstore spec of a path (:func:`spec_from_path`, the
one checker of "where is this path"), the place itself (``Location``), and how a commit
becomes visible on a local path (a rename, or a file written last).

A Location is immutable, any thread; tensorstore does not fsync: callers use
``Location.sync``. The mount table is read at each call.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.location``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from .._base import env as _env
from .._errors import UnsupportedLocationError
from . import local_files as _local
from . import s3_credentials as _s3_credentials
from . import untrusted as _untrusted
from .contexts import context, prefix_range, tensorstore
from .local_files import MAX_DOCUMENT_BYTES, walk_entries


def check_name(name: str) -> str:
    """``name`` if it is a relative storage name inside a location (no empty, ``.`` or
    ``..`` component, no backslash or NUL); ValueError otherwise."""
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
        raise ValueError(f"invalid storage name {name!r}")
    return name


# What a path argument may name, in the words of the errors below.
SUPPORTED = "a local path, file://, s3://<bucket>/, gs://<bucket>/ or memory://"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")  # two letters at least: 'C:' is a drive
_STORES = {"s3": "s3", "gs": "gcs", "memory": "memory", "file": "file"}


def spec_from_path(path: Any, *, what: str = "checkpoint location") -> dict[str, Any]:
    """The kvstore spec, its path ending in '/', of an os.PathLike/str path, an
    s3/gs/memory/file URL or a kvstore dict. Any other scheme, an empty path, NUL or
    non-UTF-8 text, a leading ``~``, a URL's ``?``/``#`` part, a ``.``/``..``/empty
    component in a store key, and whatever tensorstore refuses is an
    UnsupportedLocationError naming ``what``, before anything is opened."""
    if isinstance(path, dict):
        spec = _dict_spec(path, what)
    elif isinstance(path, (str, bytes, os.PathLike)):
        spec = _url_spec(_path_text(path, what), what)
    else:
        raise UnsupportedLocationError(
            f"{what}: expected a path (str or os.PathLike), a URL or a kvstore spec dict, "
            f"found {_env.found(path)}"
        )
    spec["path"] = spec.get("path", "").rstrip("/") + "/"
    if spec["driver"] != "file" and spec["path"] == "/":
        spec["path"] = ""
    _check_store_spec(spec, path, what)
    return spec


def _path_text(path: Any, what: str) -> str:
    """``path`` as text, refused when it names nothing or could not be stored."""
    try:
        text = os.fsdecode(path)
    except (TypeError, UnicodeError) as e:  # a PathLike whose fspath is no text
        raise UnsupportedLocationError(f"{what} {_env.found(path)}: not a path ({e})") from None
    if not text:
        raise UnsupportedLocationError(
            f"{what}: an empty path, which would name the current directory; expected "
            f"{SUPPORTED} (write '.' to mean the current directory)"
        )
    if "\0" in text:
        raise UnsupportedLocationError(f"{what} {text!r}: holds a NUL character")
    if text != text.strip() and not os.path.lexists(text):  # a config's stray space, a "\n"
        raise UnsupportedLocationError(
            f"{what} {text!r}: begins or ends with whitespace (a stray space or newline "
            f"from a config or a file?), so it would name another place than "
            f"{text.strip() or 'the one meant'!r}; strip it (a folder of that name that "
            f"exists is read as is)"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedLocationError(
            f"{what} {text!r}: not valid UTF-8 at position {e.start} (a file name in "
            f"another encoding); tensorstore paths are UTF-8 text: rename it"
        ) from None
    if text == "~" or text.startswith(("~/", "~\\")) or re.match(r"^~[\w.-]+(/|$)", text):
        raise UnsupportedLocationError(
            f"{what} {text!r}: '~' is not expanded here (this would be a folder named "
            f"{text.split('/')[0]!r} in the current directory); pass "
            f"os.path.expanduser(path), or './{text}' for a folder of that name"
        )
    return text


def _local_abspath(text: str, what: str) -> str:
    """The absolute form of a local path; a backslash (a Windows path) is refused."""
    if "\\" in text:
        raise UnsupportedLocationError(
            f"{what} {text!r}: holds a backslash (a Windows path?); expected a POSIX path, "
            f"'/' between folders"
        )
    return os.path.abspath(text)


def _dict_spec(path: dict[str, Any], what: str) -> dict[str, Any]:
    spec = dict(path)
    if not isinstance(spec.get("driver"), str):
        raise UnsupportedLocationError(f"{what}: a kvstore spec needs a 'driver', found {path!r}")
    if not isinstance(spec.get("path", ""), str):
        raise UnsupportedLocationError(
            f"{what}: the kvstore spec's 'path' must be a str, found {_env.found(spec['path'])}"
        )
    if spec["driver"] == "file":
        if not spec.get("path"):
            raise UnsupportedLocationError(
                f"{what}: the file kvstore spec {path!r} names no 'path' (it would be the "
                f"current directory)"
            )
        spec["path"] = _local_abspath(_path_text(spec["path"], what), what)
    return spec


def _check_store_spec(spec: dict[str, Any], given: Any, what: str) -> None:
    """Refuses store keys with an empty, '.' or '..' component (kept literally by a
    store), then what tensorstore's own parse of ``spec`` refuses."""
    if spec["driver"] != "file":
        parts = spec["path"].rstrip("/").split("/") if spec["path"] else []
        bad = [p for p in parts if p in ("", ".", "..")]
        if bad or "\0" in spec["path"]:
            raise UnsupportedLocationError(
                f"{what} {_shown(given)}: the key {spec['path']!r} holds a "
                f"{bad[0] if bad else 'NUL'!r} component; a {spec['driver']} store keeps it "
                f"literally (no folder is left or entered): expected a/b/c"
            )
    if set(spec) == {"driver", "path"} and spec["driver"] == "file":  # an absolute local
        return  # path: nothing for tensorstore to refuse (a local command starts without it)
    try:
        tensorstore().KvStore.Spec(spec)
    except (ValueError, TypeError, RuntimeError) as e:
        raise UnsupportedLocationError(f"{what} {_shown(given)}: {e}") from None


def _shown(path: Any) -> str:
    return repr(os.fspath(path) if isinstance(path, (str, os.PathLike)) else path)


def _url_spec(text: str, what: str) -> dict[str, Any]:
    found = _SCHEME.match(text)
    if found is None:  # a plain (or Windows-like) path
        return {"driver": "file", "path": _local_abspath(text, what)}
    scheme = found.group(1).lower()
    if scheme not in _STORES:
        raise UnsupportedLocationError(
            f"{what} {text!r}: unsupported store {scheme + ':'!r}; supported: {SUPPORTED}"
        )
    url = urlparse(text)
    if not text[found.end() :].startswith("//"):
        raise UnsupportedLocationError(
            f"{what} {text!r}: expected {scheme}://..., found no '//' after {scheme}:"
        )
    if url.query or url.fragment or text.endswith(("?", "#")):
        raise UnsupportedLocationError(
            f"{what} {text!r}: a URL's '?' or '#' part names no place (it would be dropped); "
            f"expected {scheme}://... without them"
        )
    if scheme in ("s3", "gs") and not url.netloc:
        raise UnsupportedLocationError(
            f"{what} {text!r}: expected {scheme}://<bucket>/<path>, found no bucket"
        )
    if scheme == "memory":
        return {"driver": "memory", "path": (url.netloc + url.path).lstrip("/")}
    if scheme == "file":
        if url.netloc not in ("", "localhost"):  # file://rel/x would silently name /x
            raise UnsupportedLocationError(
                f"{what} {text!r}: expected file:///<absolute path>, found the host {url.netloc!r}"
            )
        if not url.path:  # file:// alone would name the current directory
            raise UnsupportedLocationError(
                f"{what} {text!r}: expected file:///<absolute path>, found no path"
            )
        return {"driver": "file", "path": _local_abspath(_path_text(url.path, what), what)}
    # the one '/' after the bucket goes; another ('s3://b//x') is refused as empty below
    spec = {"driver": _STORES[scheme], "bucket": url.netloc, "path": url.path[1:]}
    if scheme == "s3":
        spec.update(_s3_credentials.settings_from_env())
    return spec


MOUNTINFO = "/proc/self/mountinfo"


def mount_type_in(path: str, mountinfo: str) -> str | None:
    """The filesystem type of the longest mount point holding absolute ``path`` in
    ``mountinfo`` (a ``/proc/<pid>/mountinfo``'s text); None when no line parses."""
    best, kind = -1, None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4]  # spaces, tabs, newlines and backslashes are octal escapes in it
        for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            point = point.replace(code, char)
        fstype = line.split(" - ", 1)[1].split(" ", 1)[0]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # a later mount over the same point wins
            best, kind = len(point), fstype
    return kind


def mount_type(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (its nearest existing ancestor,
    links resolved), or None where the mount table cannot be read."""
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
    rename (``FOP_COMMIT``; ``auto``: on a FUSE mount)."""
    how = _env.read("FOP_COMMIT")
    if how != "auto":
        return how == "file"
    return is_fuse(mount_type(path))


if TYPE_CHECKING:
    import tensorstore as ts


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
        """Whether a commit here is a directory rename (local disk, but not a FUSE mount
        of a bucket: there, as on object stores, a file written last; ``_storage.mounts``)."""
        return self.is_local and not commits_by_file(self.path)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        spec = self.spec
        if spec["driver"] == "file":
            return spec["path"].rstrip("/") or "/"
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
        spec = spec_from_path(path)
        return cls(json.dumps(spec, sort_keys=True))

    def _with_path(self, path: str) -> Location:
        spec = self.spec
        spec["path"] = path
        return Location(json.dumps(spec, sort_keys=True))

    def child(self, name: str) -> Location:
        return self._with_path(self.path + check_name(name) + "/")

    def sibling(self, name: str) -> Location:
        return self.parent.child(name)

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
        kvstore = tensorstore().KvStore  # imported at the first store opened (kvstore)
        return kvstore.open(self.spec, context=context(local=self.is_local)).result()

    # -- small files ---------------------------------------------------------------

    def read_bytes(self, name: str, *, max_bytes: int | None = MAX_DOCUMENT_BYTES) -> bytes | None:
        """The file's bytes, or None when it does not exist.

        Raises ForeignEntryError for a symlink or non-regular file (never followed or
        read) and CorruptCheckpointError above ``max_bytes`` (metadata and JSON files:
        ``MAX_SMALL_FILE_BYTES``; None for array data copied whole).
        """
        if self.is_local:
            return _local.read_file(self.path, check_name(name), max_bytes)
        return self.read_versioned(name, max_bytes=max_bytes)[0]

    def read_pieces(self, name: str, piece: int) -> Iterator[bytes] | None:
        """The file as pieces of at most ``piece`` bytes, read as they are taken (local
        disk: one piece held at a time, never through a link; an object store: read
        whole, one piece); None when it does not exist."""
        if self.is_local:
            return _local.read_pieces(self.path, check_name(name), piece)
        data = self.read_bytes(name, max_bytes=None)
        return None if data is None else iter((data,))

    def write_bytes(
        self, name: str, data: bytes | Iterable[bytes], *, durable: bool = True
    ) -> None:
        """Writes the file whole (a temporary name, then a rename on local disk); with
        ``durable``, fsyncs the file and its directory (else a later :meth:`sync` does).
        ``data``: the bytes, or pieces (local disk: each written as it is taken; an
        object store takes a file whole: joined first)."""
        if self.is_local:
            _local.write_file(self.path, check_name(name), data, durable=durable)
            return
        if not isinstance(data, (bytes, bytearray, memoryview)):
            data = b"".join(data)
        self._kv().write(check_name(name), data).result()

    def read_versioned(self, name: str, *, max_bytes: int | None = MAX_DOCUMENT_BYTES) -> Any:
        """Object stores: ``(bytes or None, generation)``: the file and the storage
        generation it was read at (also for a missing file), for :meth:`write_if`."""
        result = self._kv().read(check_name(name)).result()
        if result.state != "value":
            return None, result.stamp.generation
        _local.check_size(len(result.value), f"{self}/{name}", max_bytes)
        return bytes(result.value), result.stamp.generation

    def write_if(self, name: str, data: bytes | None, generation: Any) -> Any | None:
        """Object stores: writes (``None``: deletes) the file only if its stored
        generation is still ``generation`` (one conditional request); returns the new
        generation, or None when someone else wrote or deleted it meanwhile."""
        stamp = self._kv().write(check_name(name), data, if_equal=generation).result()
        return stamp.generation or None

    def delete(self, name: str) -> None:
        """Deletes one file (no error if it is absent)."""
        if self.is_local:
            _local.delete_file(self.path, check_name(name))
            return
        key = check_name(name)
        only_key = tensorstore().KvStore.KeyRange(inclusive_min=key, exclusive_max=key + "\0")
        self._kv().delete_range(only_key).result()

    def exists(self, name: str) -> bool:
        """True for a regular file or directory at ``name``; ForeignEntryError for a
        symlink or special file there (or on the way there)."""
        if self.is_local:
            return _local.exists(self.path, check_name(name))
        return self.read_bytes(name) is not None

    # -- directories ---------------------------------------------------------------

    def is_dir(self) -> bool:
        """True when anything at all is stored under this location."""
        if self.is_local:
            return os.path.isdir(self.path)
        return bool(self._kv().list(range=prefix_range(""), strip_prefix_length=0).result()[:1])

    def child_kinds(self) -> dict[str, str]:
        """Local only: ``{name: "dir" | "file" | "symlink" | "other"}`` of the immediate
        children, from the directory entries themselves (no symlink is followed)."""
        if not self.is_local:
            raise NotImplementedError(f"entry kinds are only listed on local disks, not {self}")
        return _local.child_kinds(self.path)

    def check_no_links(self, *, read: Callable[[list[str], bool], bool] | None = None) -> None:
        """Local only (no-op elsewhere): raises ForeignEntryError naming the first
        symlink or special file anywhere under this location (with ``read``, the
        names a reader opens: ``read(relative path parts, is_dir)``; a user's link at
        another name is never opened, and left alone). One ``scandir`` walk, no file
        opened; restore calls it once per checkpoint, since tensorstore's file driver
        follows symlinks."""
        if not self.is_local:
            return
        top = self.path.rstrip("/") or "/"
        for entry in walk_entries(top):
            if entry.is_file(follow_symlinks=False):
                continue
            parts = os.path.relpath(entry.path, top).split(os.sep)
            if read is None or read(parts, False) or read(parts, True):  # a file's or a dir's
                _local.require_regular(entry.stat(follow_symlinks=False), entry.path)

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

    def keys(self) -> list[str]:
        """Every key (file) under this object-store location, recursively, as one
        listing; local disks: NotImplementedError (walk the directory instead)."""
        if self.is_local:
            raise NotImplementedError(f"keys are listed on object stores only, not {self}")
        return [k.decode("utf-8") for k in self._kv().list().result()]

    def size_bytes(self) -> int | None:
        """Total bytes of the files under a local location (None: part of it cannot be
        read)."""
        if not self.is_local:
            raise NotImplementedError(f"sizes are only listed on local disks, not {self}")
        return _untrusted.size_bytes(self.path)

    def makedirs(self) -> None:
        """Creates a local directory (and its parents); nothing to do on object stores."""
        if self.is_local:
            _local.make_dirs(self.path)

    def remove(self) -> None:
        """Removes everything under this location (no error if nothing is there).

        Proves nothing: the package removes only through ``_core/ownership.py`` (which proves
        a place ours first); this primitive is left for tests that clean up by hand.

        Local: only a real directory is removed; symlinks inside it are unlinked, never
        followed. A location that is itself a symlink or not a directory is refused
        with ForeignEntryError (what it points to is left alone).
        """
        if self.is_local:
            path = self.path.rstrip("/")  # a trailing '/' would make lstat follow a link
            _untrusted.remove_tree(path)
            return
        self._kv().delete_range(prefix_range("")).result()

    def rename(self, dst: Location) -> None:
        """Atomic rename of a local directory, then fsync of the parent."""
        if not (self.is_local and dst.is_local):
            raise NotImplementedError("rename is only supported on the local filesystem")
        os.rename(self.path.rstrip("/"), dst.path.rstrip("/"))
        _local.fsync_dir(os.path.dirname(dst.path.rstrip("/")))

    def newest_mtime(self) -> float:
        """Local only: the latest modification time of this directory and its immediate
        entries (``lstat``: no link followed); ``inf`` when it cannot be read."""
        return _untrusted.newest_mtime(self.path.rstrip("/"))

    def exchange(self, other: Location) -> bool:
        """Atomically swaps two local directories (``renameat2(RENAME_EXCHANGE)``), then
        fsyncs the parent; False where the kernel or filesystem cannot (the caller then
        renames in two steps)."""
        if not (self.is_local and other.is_local):
            return False
        return _local.exchange(self.path.rstrip("/"), other.path.rstrip("/"))

    def sync(self) -> None:
        """Makes everything written under a local location durable (no-op elsewhere:
        an object store's write is durable once acknowledged).

        One ``syncfs`` of the filesystem costs about one fsync of a single large file,
        while an fsync per file costs a disk flush each; where ``syncfs`` is missing,
        every file and directory is fsynced.
        """
        if not self.is_local:
            return
        # a save with no array data may not have made its staging directory yet
        os.makedirs(self.path, exist_ok=True)
        _local.sync_tree(self.path)
