"""Tensorstore kvstores: the spec of a path (the one checker of "where is this path").

An object store's refusal is worded by ``store_errors``; tensorstore and the shared
contexts: ``contexts``; an ``s3://`` store's settings from the environment:
``s3_credentials``. Pure functions: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.kvstore``.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlparse

from .._errors import UnsupportedLocationError
from . import s3_credentials as _s3_credentials
from .contexts import tensorstore


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
    s3/gs/memory/file URL or a kvstore dict. The one checker of "where is this path":
    any other ``scheme:`` (and a store URL without ``//`` or without a bucket) is a
    UnsupportedLocationError naming ``what`` and what is supported, never read as a
    local name. So is a path naming no place of its own (empty: it would be the current
    directory), text a store cannot hold (NUL, not UTF-8), a leading ``~`` (never
    expanded: it would be a folder named ``~``), a URL's ``?``/``#`` part (dropped
    otherwise), a ``.``/``..``/empty component in a store key, and anything tensorstore
    itself refuses (a bucket name, a driver): all before anything is opened."""
    if isinstance(path, dict):
        spec = _dict_spec(path, what)
    elif isinstance(path, (str, bytes, os.PathLike)):
        spec = _url_spec(_path_text(path, what), what)
    else:
        raise UnsupportedLocationError(
            f"{what}: expected a path (str or os.PathLike), a URL or a kvstore spec dict, "
            f"found {type(path).__name__} {_cut(path)}"
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
        raise UnsupportedLocationError(f"{what} {_cut(path)}: not a path ({e})") from None
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
    """The absolute form of a local path; a backslash is refused here, where it enters
    (no name below it could be made: it was a raw "invalid storage name" at save)."""
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
            f"{what}: the kvstore spec's 'path' must be a str, found "
            f"{type(spec['path']).__name__} {_cut(spec['path'])}"
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
    """Store keys with an empty, '.' or '..' component (kept literally by a store, so
    never the place they read as), then tensorstore's own parse of ``spec``."""
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


def _cut(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    # the one '/' after the bucket goes; another ('s3://b//x': the key '/x') stays, and is
    # refused below as an empty component (it was quietly read as 'x', another key)
    spec = {"driver": _STORES[scheme], "bucket": url.netloc, "path": url.path[1:]}
    if scheme == "s3":
        spec.update(_s3_credentials.settings_from_env())
    return spec
