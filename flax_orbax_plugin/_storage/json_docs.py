"""JSON documents on storage: what a reader accepts of each kind, declared once.

Every JSON document this library writes and reads back (a checkpoint's metadata, data
indexes, step manifests, commit, pending and per-host markers, run records, JSON
items and iterator states) has a :class:`DocKind`: the most bytes and the deepest
nesting a reader accepts, and whether an object may repeat a key. Readers parse with
:func:`parse`: the size is checked first, then the nesting depth by a scan of the bytes
(so the parser never recurses past it), then JSON, refusing every non-finite number,
text that is not UTF-8 (an escaped lone surrogate) and, where the kind says so, every
repeated key; CorruptCheckpointError naming the file. Writers encode with
:func:`encode`, which refuses with a StructureError naming the document, what was
found and the limit, everything :func:`parse` would refuse: a writer never commits
what a reader refuses. Times a record carries are checked by :func:`check_time` on
both sides (the range the platform can format as a date).

Pure functions, no state: safe from any thread.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
from typing import Any

import numpy as np

from .._errors import CorruptCheckpointError, StructureError

__all__ = [
    "COMMIT_MARKER",
    "DATA_INDEX",
    "DocKind",
    "HOST_MARKER",
    "JSON_ITEM",
    "MAX_DOCUMENT_BYTES",
    "MAX_TIME",
    "METADATA",
    "PENDING_MARKER",
    "RUN_RECORD",
    "STEP_MANIFEST",
    "TIER_RECORD",
    "check_time",
    "depth",
    "encode",
    "parse",
]


@dataclasses.dataclass(frozen=True)
class DocKind:
    """The limits of one kind of document: ``what`` names it in messages."""

    what: str
    max_bytes: int
    max_depth: int
    unique_keys: bool = True  # an object listing a key twice is damage


# The one declaration of the reader's limits (FORMAT.md, "Limits"). The metadata of a
# checkpoint lets a repeated key pass to the parser (checking costs ~60% of its parse
# time); its records are checked field by field, paths unique, after parsing.
METADATA = DocKind("metadata document (_METADATA.json)", 64 << 20, 64, unique_keys=False)
DATA_INDEX = DocKind("data index (data/<p>.json)", 64 << 20, 8)
STEP_MANIFEST = DocKind("step manifest (_CHECKPOINT.json)", 64 << 20, 8)
COMMIT_MARKER = DocKind("commit marker (_COMMITTED)", 64 << 20, 8)  # one entry per process
PENDING_MARKER = DocKind("pending marker (_PENDING.json)", 1 << 16, 4)  # + what it keeps
HOST_MARKER = DocKind("per-host marker (_HOST.json)", 1 << 20, 8)
RUN_RECORD = DocKind("run record (_RUN.json)", 4096, 4)
TIER_RECORD = DocKind("record of damaged steps (_DAMAGED.json)", 16 << 20, 8)
JSON_ITEM = DocKind("JSON item (extras, iterator state, value.json)", 64 << 20, 100)
# The most any small file of this library holds (a read of one is capped at this).
MAX_DOCUMENT_BYTES = max(
    k.max_bytes for k in (METADATA, DATA_INDEX, STEP_MANIFEST, COMMIT_MARKER, JSON_ITEM)
)

# The latest time a record may carry: 9999-12-30 UTC, a day before datetime's end, so
# that it formats as a date in every time zone.
MAX_TIME = float(datetime.datetime(9999, 12, 30, tzinfo=datetime.UTC).timestamp())

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_QUOTE, _OPEN, _CLOSE = ord('"'), ord("{"), ord("}")  # '[' | 32 == '{', ']' | 32 == '}'


def depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (brackets
    inside strings not counted), found without parsing: a few vectorised passes."""
    if b"\\" in raw:
        raw = _ESCAPE.sub(b"", raw)  # then every '"' opens or closes a string
    a = np.frombuffer(raw, np.uint8)
    folded = a | 32
    at = np.flatnonzero((folded == _OPEN) | (folded == _CLOSE))
    if not at.size:
        return 0
    inside = np.bitwise_xor.accumulate(a == _QUOTE)
    at = at[~inside[at]]
    steps = np.where(folded[at] == _OPEN, np.int32(1), np.int32(-1))
    return int(np.cumsum(steps).max(initial=0))


class _Repeated(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise _Repeated(key)
            seen.add(key)
    return out


class _NonFinite(ValueError):
    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def _finite(text: str) -> float:
    value = float(text)  # 1e999 overflows to infinity: refused like Infinity
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


def _constant(name: str) -> Any:
    raise _NonFinite(name)


def parse(raw: bytes, where: str, kind: DocKind) -> Any:
    """The JSON value of ``raw``, read from storage as a document of ``kind``;
    CorruptCheckpointError naming ``where`` when it is larger or deeper than ``kind``
    allows, not UTF-8 JSON, holds a non-finite number, a lone surrogate or (if
    ``kind.unique_keys``) an object with a repeated key."""
    if len(raw) > kind.max_bytes:
        raise CorruptCheckpointError(
            f"{where}: {len(raw)} bytes, more than a {kind.what} may hold ({kind.max_bytes})"
        )
    found = depth(raw)
    if found > kind.max_depth:
        raise CorruptCheckpointError(
            f"{where}: nested {found} levels deep, more than a {kind.what} may be "
            f"({kind.max_depth})"
        )
    hook = _unique if kind.unique_keys else None
    try:
        value = json.loads(
            raw.decode("utf-8"),
            parse_constant=_constant,
            parse_float=_finite,
            object_pairs_hook=hook,
        )
    except _Repeated as e:
        raise CorruptCheckpointError(
            f"malformed {where}: field {e.key[:80]!r}: expected once in its object, found twice"
        ) from None
    except _NonFinite as e:
        raise CorruptCheckpointError(
            f"malformed {where}: field {_field_before(raw, e.text)}: expected a finite "
            f"number, found {e.text[:40]}"
        ) from None
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        text = str(e)
        text = text if len(text) <= 200 else text[:197] + "..."
        raise CorruptCheckpointError(f"{where} is not valid JSON: {text}") from None
    if b"\\ud" in raw or b"\\uD" in raw:  # a surrogate escaped: a pair, or a lone one
        bad = unencodable(value)
        if bad is not None:
            raise CorruptCheckpointError(
                f"malformed {where}: {bad[0]}: expected UTF-8 text, found a lone "
                f"surrogate in {bad[1]!r}"
            )
    return value


_KEY_BEFORE = re.compile(rb'"([^"\\]{1,64})"\s*:\s*[\[\s]*$')


def _field_before(raw: bytes, text: str) -> str:
    """The key under which the number ``text`` first appears in ``raw`` (for the error
    message), else its byte offset."""
    at = raw.find(text.encode())
    if at < 0:
        return "?"
    match = _KEY_BEFORE.search(raw[max(0, at - 200) : at])
    return match.group(1).decode(errors="replace") if match else f"at byte {at}"


def encode(value: Any, where: str, kind: DocKind, **dumps: Any) -> bytes:
    """The JSON bytes of ``value`` (``dumps``: json.dumps options; compact by
    default) as a document of ``kind`` to be written at ``where``. StructureError
    naming ``where`` for anything :func:`parse` would refuse: larger or deeper than
    ``kind`` allows, a non-finite number, text with a lone surrogate."""
    dumps.setdefault("separators", (",", ":"))
    try:
        text = json.dumps(value, allow_nan=False, **dumps)
    except RecursionError:
        raise StructureError(
            f"{where}: nested too deeply for a {kind.what} (at most {kind.max_depth} levels)"
        ) from None
    except (ValueError, TypeError) as e:  # NaN or infinity; a value JSON has no type for
        raise StructureError(f"{where}: cannot be stored as a {kind.what}: {e}") from None
    if "\\ud" in text:  # a surrogate escaped: a pair (fine), or a lone one (refused)
        bad = unencodable(value)
        if bad is not None:
            raise StructureError(
                f"{where}: {bad[0]} holds text that cannot be encoded as UTF-8 (a lone "
                f"surrogate: {bad[1]!r}); a reader would refuse it"
            )
    raw = text.encode("utf-8")
    if len(raw) > kind.max_bytes:
        raise StructureError(
            f"{where}: a {kind.what} of {len(raw)} bytes, more than a reader accepts "
            f"({kind.max_bytes}); nothing was committed"
        )
    found = depth(raw)
    if found > kind.max_depth:
        raise StructureError(
            f"{where}: nested {found} levels deep, more than a reader accepts in a "
            f"{kind.what} ({kind.max_depth})"
        )
    return raw


def unencodable(value: Any) -> tuple[str, str] | None:
    """(where in ``value``, the text) of the first str, as a dict key or a value,
    that UTF-8 cannot encode (a lone surrogate); None when there is none. Walked
    without recursion, to the depth a document may have."""
    stack: list[tuple[Any, str]] = [(value, "the value")]
    while stack:
        x, at = stack.pop()
        if isinstance(x, str):
            if not _encodes(x):
                return at, _shown(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                if isinstance(k, str) and not _encodes(k):
                    return f"the key {_shown(k)!r} of {at}", _shown(k)
                stack.append((v, f"{at}[{k!r}]"[:200]))
        elif isinstance(x, list | tuple):
            stack.extend((v, f"{at}[{i}]"[:200]) for i, v in enumerate(x))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def check_time(value: Any, where: str, field: str, *, stored: bool) -> float:
    """``value`` as seconds since the epoch in [0, :data:`MAX_TIME`] (what the platform
    formats as a date). A record read back (``stored``): CorruptCheckpointError naming
    ``where`` and ``field``; one about to be written: ValueError."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and 0 <= value <= MAX_TIME:
        return float(value)
    message = (
        f"{where}: field {field}: expected a time in seconds since the epoch up to "
        f"{MAX_TIME:.0f} (year 9999), found {str(value)[:40]}"
    )
    raise CorruptCheckpointError(message) if stored else ValueError(message)
