"""``--json``: one JSON document on stdout per command, each described by a JSON Schema:
the contract (``docs/cli.md``, a test compares): fields may be added, none removed or
changed in meaning. Sizes are bytes, times ISO 8601.
"""

from __future__ import annotations

import json
import sys
from typing import Any

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
