"""Checked JSON: checksums, canonical bytes, bounded parsing and field validators.

Every record's ``from_json`` validates its fields with the helpers here and raises
:class:`CorruptCheckpointError` naming the file and the field; :func:`decode` bounds
what an untrusted file may hold, :func:`decode_checked` and :func:`parse_sealed`
check the sha256 recorded at commit and a sealed file's own checksum.
"""

from __future__ import annotations

import hashlib
import json
import re
import reprlib
from collections.abc import Mapping
from typing import Any, NoReturn

from ..._errors import CorruptCheckpointError
from ..._storage import json_docs as _docs

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", re.ASCII)
_SHA256 = re.compile(r"^[0-9a-f]{64}$", re.ASCII)


def is_safe_name(name: Any) -> bool:
    """A name usable as one path component: letters, digits, '_', '-', '.'; no '..'."""
    return isinstance(name, str) and bool(_SAFE_NAME.match(name)) and ".." not in name


# -- checksums and JSON -------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(obj: Any) -> bytes:
    """Compact, deterministic JSON bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def decode(raw: bytes, where: str, kind: _docs.DocKind) -> Any:
    """Parses JSON bytes read from an untrusted store as a document of ``kind`` (its
    size, depth and key limits: ``_storage/json_docs.py``); errors name the file."""
    return _docs.parse(raw, where, kind)


def decode_checked(raw: bytes, where: str, expected_sha256: str, kind: _docs.DocKind) -> Any:
    """Parses ``raw`` after checking it against the checksum recorded at commit."""
    found = sha256(raw)
    if found != expected_sha256:
        sha256_mismatch(where, expected_sha256, found)
    return decode(raw, where, kind)


def sha256_mismatch(where: str, expected: str, found: str) -> NoReturn:
    """Raises the CorruptCheckpointError of a JSON file whose sha256 differs from the
    one recorded at commit."""
    raise CorruptCheckpointError(
        f"{where}: checksum mismatch: expected sha256 {expected[:16]}... "
        f"(recorded at commit), found {found[:16]}...; the file was changed or damaged"
    )


def seal(body: dict[str, Any], kind: _docs.DocKind | None = None) -> bytes:
    """JSON bytes of ``body`` plus a ``checksum`` of its own canonical form; with
    ``kind``, refused (StructureError) past what a reader of that kind accepts."""
    sealed = dict(body, checksum=sha256(encode(body)))
    if kind is None:
        return encode(sealed)
    return _docs.encode(sealed, kind.what, kind, sort_keys=True)


def parse_sealed(raw: bytes, where: str, kind: _docs.DocKind) -> dict[str, Any]:
    obj = decode(raw, where, kind)
    need(isinstance(obj, dict), where, "the file", "a JSON object", obj)
    body = dict(obj)
    checksum = body.pop("checksum", None)
    need(isinstance(checksum, str), where, "checksum", "a sha256 string", checksum)
    try:
        canonical = encode(body)
    except RecursionError:  # parsed, but nested too deep to encode again
        raise CorruptCheckpointError(f"{where}: nested too deeply to be a valid file") from None
    if sha256(canonical) != checksum:
        raise CorruptCheckpointError(f"{where}: checksum mismatch: the file was changed or damaged")
    return body


# -- validation helpers ------------------------------------------------------------------


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 60, 60


def show(value: Any) -> str:
    """A short repr of an untrusted value: bounded in time, size and depth (a deeply
    nested or huge value never recurses or builds its whole repr)."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def fail(where: str, field: str, expected: str, found: Any) -> NoReturn:
    raise CorruptCheckpointError(
        f"malformed {where}: field {field}: expected {expected}, found {show(found)}"
    )


def need(cond: bool, where: str, field: str, expected: str, found: Any) -> None:
    if not cond:
        fail(where, field, expected, found)


def one_of(x: Any, names: frozenset[str]) -> bool:
    return isinstance(x, str) and x in names


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def int_field(obj: Mapping, key: str, where: str, field: str, *, lo: int = 0, hi: int = 1 << 62):
    value = obj.get(key)
    need(is_int(value) and lo <= value <= hi, where, field, f"an int in [{lo}, {hi}]", value)
    return value


def time_field(obj: Mapping, key: str, where: str, field: str) -> float:
    """An optional time in seconds since the epoch (0.0 when absent), within what the
    platform formats as a date (``json_docs.check_time``)."""
    return _docs.check_time(obj.get(key, 0.0), where, field, stored=True)


def str_field(obj: Mapping, key: str, where: str, field: str) -> str:
    value = obj.get(key)
    need(isinstance(value, str), where, field, "a string", value)
    return value


def opt_str(obj: Mapping, key: str, where: str, *, limit: int = 1000) -> str:
    """An optional, informational string field ("" when absent)."""
    value = obj.get(key, "")
    need(isinstance(value, str) and len(value) <= limit, where, key, "a short string", value)
    return value


def check_format_version(obj: Mapping, where: str, name: str, key: str, known: int) -> int:
    """Checks the ``format`` name and returns the version under ``key``; a version this
    library does not know yet is refused with the way out (upgrade)."""
    need(obj.get("format") == name, where, "format", repr(name), obj.get("format"))
    version = int_field(obj, key, where, key, lo=1, hi=1 << 30)
    if version > known:
        raise CorruptCheckpointError(
            f"{where} has {key} {version}; this version of flax_orbax_plugin reads up to "
            f"{known}: upgrade flax_orbax_plugin"
        )
    return version


def files_field(obj: Mapping, where: str) -> dict[str, str]:
    files = obj.get("files")
    need(isinstance(files, dict), where, "files", "an object {file: sha256}", files)
    for name, digest in files.items():
        parts = name.split("/")
        need(
            all(is_safe_name(p) or p.startswith("_") and is_safe_name(p[1:]) for p in parts),
            where,
            f"files[{name!r}]",
            "a relative path of safe names",
            name,
        )
        need(
            isinstance(digest, str) and bool(_SHA256.match(digest)),
            where,
            f"files[{name!r}]",
            "a sha256 hex digest",
            digest,
        )
    return dict(files)
