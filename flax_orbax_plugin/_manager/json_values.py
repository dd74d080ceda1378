"""The JSON values of a step's non-pytree items (extras, the step, iterator states):
Python values to JSON-compatible data and back.

Bytes, NaN and infinities are tagged (``{"__bytes__": b64}``, ``{"__float__": "nan"}``)
so they round-trip exactly. A value nesting more than ``MAX_JSON_DEPTH`` levels (or
holding itself) is refused on write with a ValueError naming the item, the same limit
the reader holds a committed file to (``_format.steps.read_item_json``): the writer
never commits what a reader refuses, and neither side recurses past the interpreter's
stack. Pure functions; safe from any thread.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._format.steps import MAX_JSON_DEPTH, json_too_deep

__all__ = ["from_json", "to_json"]


def to_json(value: Any, where: str, *, wrapped: int = 0) -> Any:
    """``value`` as JSON-compatible data (see the module docstring); ValueError /
    TypeError naming ``where`` and the part that cannot be stored. ``wrapped``: the
    levels of the file around the value (1 for an iterator's ``{"state": ...}``)."""
    limit = MAX_JSON_DEPTH - wrapped
    # Checked before encoding (no recursion past the limit, a cycle refused) and after
    # (array dimensions and the bytes/float tags nest too): what the reader checks.
    out = None if json_too_deep(value, limit) else _encode(value, where)
    if out is None or json_too_deep(out, limit):
        raise ValueError(
            f"{where}: nested more than {limit} levels of lists and dicts (or holds "
            f"itself); a JSON item's file may nest at most {MAX_JSON_DEPTH}, so that every "
            f"reader can read it"
        )
    return out


def _encode(value: Any, where: str) -> Any:
    """Encode ``value`` as JSON-compatible data; bytes become ``{"__bytes__": b64}``,
    NaN and infinities ``{"__float__": "nan" | "inf" | "-inf"}``."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):  # NaN and infinities are not JSON: tagged, exactly
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, np.generic) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        arr = np.asarray(value)
        if arr.ndim == 0:
            return _encode(arr.item(), where)
        return [_encode(x, where) for x in arr.tolist()]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: JSON keys must be str, found {k!r}")
            if k in ("__bytes__", "__float__"):
                raise ValueError(f"{where}: the key {k!r} is reserved")
            out[k] = _encode(v, f"{where}/{k}")
        return out
    if isinstance(value, list | tuple):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(
        f"{where}: cannot store a {type(value).__name__} as JSON; extras and iterator "
        "states must be JSON values (dict, list, str, int, float, bool, None, bytes)"
    )


def from_json(value: Any) -> Any:
    """The value :func:`to_json` encoded (``value``: read through the depth-checked
    ``read_item_json``, so this recursion is bounded)."""
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        if set(value) == {"__float__"} and value["__float__"] in ("nan", "inf", "-inf"):
            return float(value["__float__"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value
