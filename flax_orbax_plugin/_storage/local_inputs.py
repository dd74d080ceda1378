"""Inputs only a local file can serve (a safetensors or msgpack file, a key map), for the
importers, exporters and the command line. Pure functions: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.location``.
"""

from __future__ import annotations

import os
from typing import Any

from .._errors import UnsupportedLocationError
from .location import _SCHEME, _STORES, _shown, spec_from_path


def local_path(path: Any, *, what: str, note: str = "") -> str:
    """The local path ``path`` names (a plain path as given, a ``file://`` URL's path).
    An object-store URL or spec is an UnsupportedLocationError naming ``what``, the
    store and ``note`` (what to do instead), never a local name such as ``./s3:/bucket``."""
    text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else None
    scheme = _SCHEME.match(text) if text is not None else None
    if scheme is not None and scheme.group(1).lower() not in _STORES:
        raise UnsupportedLocationError(
            f"{what} {text!r}: a {scheme.group(1) + ':'!r} URL, but {what} must be a local "
            f"path (or file://){': ' + note if note else ''}"
        )
    spec = spec_from_path(path, what=what)
    if spec["driver"] == "file":
        if text is not None and not _SCHEME.match(text):
            return text
        return spec["path"].rstrip("/") or "/"
    raise UnsupportedLocationError(
        f"{what} {_shown(path)}: names an object store ({spec['driver']}), but {what} must "
        f"be a local path (or file://){': ' + note if note else ''}"
    )
