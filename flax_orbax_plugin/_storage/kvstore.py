"""Tensorstore kvstores: the shared contexts, storage names, and the spec of a path.

A location is named by a path, an ``s3://``, ``gs://``, ``memory://`` or ``file://``
URL, or a tensorstore kvstore spec given as a dict; :func:`spec_from_path` turns any of
them into the canonical spec a :class:`~.location.Location` holds. :func:`context` is
created once per kind of store, lazily, under a lock: safe from any thread.
"""

from __future__ import annotations

import os
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


def check_name(name: str) -> str:
    """``name`` if it is a relative storage name inside a location (no empty, ``.`` or
    ``..`` component, no backslash or NUL); ValueError otherwise."""
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
        raise ValueError(f"invalid storage name {name!r}")
    return name


def spec_from_path(path: Any) -> dict[str, Any]:
    """The kvstore spec, its path ending in '/', of an os.PathLike/str path, an
    s3/gs/memory/file URL or a kvstore dict."""
    if isinstance(path, dict):
        spec = dict(path)
        if "driver" not in spec:
            raise ValueError(f"kvstore spec needs a 'driver': {path!r}")
        if spec["driver"] == "file":
            spec["path"] = os.path.abspath(spec.get("path", "."))
    else:
        spec = _url_spec(os.fspath(path))
    spec["path"] = spec.get("path", "").rstrip("/") + "/"
    if spec["driver"] != "file" and spec["path"] == "/":
        spec["path"] = ""
    return spec


def _url_spec(text: str) -> dict[str, Any]:
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
    return spec


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


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    if not prefix:
        return ts.KvStore.KeyRange()
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=end)
