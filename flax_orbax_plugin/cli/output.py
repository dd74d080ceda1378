"""What a command prints: exit codes, one-line errors, sizes, times, and the ``--json``
documents with their JSON Schemas (the contract, ``docs/cli.md``: fields may be added, none
removed or changed in meaning). The standard library only (the parser imports this)."""

from __future__ import annotations

import datetime
import json
import re
import shlex
import sys
from typing import Any

EXIT_DAMAGED = 1
EXIT_ERROR = 2
EXIT_STORE = 3  # an object store refused: no such bucket, no credentials, access denied


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def iso_time(seconds: float) -> str:
    """A POSIX time as ISO 8601 in the local zone, to the second, with its offset."""
    local = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).astimezone()
    return local.isoformat(timespec="seconds")


def shell_word(path: object) -> str:
    """``path`` as one word of a command line the user may paste."""
    return shlex.quote(str(path))


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# The library's keywords that the command line takes as flags.
_FLAGS = {"memory_limit_bytes": "--memory-limit"}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAGS) + r")(=| >= )(\d+)( \(or None\))?")


def in_flag_words(text: str) -> str:
    """``text`` with each keyword the command line takes as a flag in the flag's words."""

    def flag(m: re.Match) -> str:
        name, how, figure, none = _FLAGS[m.group(1)], m.group(2), m.group(3), m.group(4)
        said = f"{name} {figure}" if how == "=" else f"{name} {figure} or more"
        return said + (" (or leave it out)" if none else "")

    return _KEYWORD.sub(flag, text)


_STR_LIST = {"type": "array", "items": {"type": "string"}}
_INT_LIST = {"type": "array", "items": {"type": "integer"}}
_BYTES = {"type": ["integer", "null"], "minimum": 0}
_ISO = {"type": "string", "pattern": r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d([+-]\d\d:\d\d|Z)$"}


def _object(properties: dict[str, Any], *, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    required = [name for name in properties if name not in optional]
    return {"type": "object", "properties": properties, "required": required}


_STEP = _object(
    {
        "step": {"type": "integer"},
        "size_bytes": _BYTES,
        "bytes_written": _BYTES,
        "bytes_reused": _BYTES,
        "saved_at": {"anyOf": [_ISO, {"type": "null"}]},
        "items": _STR_LIST,
        "metrics": {"type": "object", "additionalProperties": {"type": "number"}},
        "damaged": {"type": ["string", "null"]},
    }
)

_LEAF = _object(
    {
        "path": {"type": "string"},
        "shape": _INT_LIST,
        "dtype": {"type": ["string", "null"]},
        "sharding": {"type": ["object", "null"]},
        "bytes": {"type": "integer", "minimum": 0},
    }
)

_ITEM = _object(
    {
        "name": {"type": "string"},
        "kind": {"type": "string"},
        "leaves": {"type": "array", "items": _LEAF},
        "total_bytes": {"type": "integer", "minimum": 0},
        "values": {"type": "integer", "minimum": 0},
        "value": {},
        # an item whose contents are not described (a custom checkpointable's): why
        "note": {"type": "string"},
    },
    optional=("leaves", "total_bytes", "values", "value", "note"),
)

_RESULT = _object(
    {
        "path": {"type": "string"},
        "step": {"type": ["integer", "null"]},
        "item": {"type": ["string", "null"]},
        "ok": {"type": "boolean"},
        "error": {"type": ["string", "null"]},
        "note": {"type": ["string", "null"]},  # a host's own copy of a step: what it holds
    },
    optional=("note",),
)

SCHEMAS: dict[str, dict[str, Any]] = {
    "list": _object(
        {
            "directory": {"type": "string"},
            "steps": {"type": "array", "items": _STEP},
            "unfinished": _STR_LIST,
            "set_aside": _STR_LIST,
            "foreign": _STR_LIST,
        }
    ),
    "inspect": _object(
        {
            "path": {"type": "string"},
            "items": {"type": "array", "items": _ITEM},
            "total_bytes": {"type": "integer", "minimum": 0},
        }
    ),
    "verify": _object(
        {
            "path": {"type": "string"},
            "ok": {"type": "boolean"},
            "damaged": {"type": "integer", "minimum": 0},
            "unreadable": {"type": "integer", "minimum": 1},  # only when a step was
            "results": {"type": "array", "items": _RESULT},
        },
        optional=("unreadable",),
    ),
    "gc": _object(
        {
            "directory": {"type": "string"},
            "dry_run": {"type": "boolean"},
            "removed_unfinished": _STR_LIST,
            "removed_steps": _INT_LIST,
            "kept_steps": _INT_LIST,
            "left_alone": _STR_LIST,
        }
    ),
}
for _schema in SCHEMAS.values():
    _schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"


def emit(document: dict[str, Any]) -> None:
    """Writes ``document`` as one line of JSON on stdout (strict: no NaN or Infinity)."""
    sys.stdout.write(json.dumps(document, sort_keys=True, allow_nan=False) + "\n")
