"""JSON items of a step (``extras``, the step, data-iterator states): their values to
JSON and back, and their files, within what a reader accepts (``json_docs.JSON_ITEM``).

:func:`to_json` converts (and checks) a value on the caller's thread, naming where in
it a problem is; :func:`encode_json` makes its bytes (refused past the reader's
limits) before anything is committed; :func:`write_json` and :func:`read_json` write
and read the file (the read checked against the step manifest's checksum). Pure
functions and single writes: any thread.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._core.commit import Written
from .._errors import StructureError
from .._format import layout as _layout
from .._format import steps as _steps
from .._storage import local_files as _docs
from .._storage.location import Location


def to_json(value: Any, where: str, depth: int = 0) -> Any:
    """Encode ``value`` as JSON-compatible data; bytes become ``{"__bytes__": b64}``,
    NaN and infinities ``{"__float__": "nan" | "inf" | "-inf"}``. What no reader
    accepts is refused here, on the caller's thread, naming where it is: text UTF-8
    cannot encode (a lone surrogate, in a value or a key), nesting deeper than a JSON
    item may have (``json_docs.JSON_ITEM``)."""
    if depth > _docs.JSON_ITEM.max_depth:
        raise StructureError(
            f"{where}: nested more than {_docs.JSON_ITEM.max_depth} levels deep, more "
            f"than a reader accepts in a JSON item"
        )
    if isinstance(value, str):
        return value if value.isascii() else _utf8(value, where)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):  # NaN and infinities are not JSON: tagged, exactly
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, np.generic) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        _check_array(value, where)
        arr = np.asarray(value)
        if arr.ndim == 0:
            return to_json(arr.item(), where, depth)
        return to_json(arr.tolist(), where, depth)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: JSON keys must be str, found {k!r}")
            if not k.isascii():
                _utf8(k, f"{where}: the key {k!r}")
            if k in ("__bytes__", "__float__"):
                raise ValueError(f"{where}: the key {k!r} is reserved")
            out[k] = to_json(v, f"{where}/{k}", depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [to_json(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise TypeError(
        f"{where}: cannot store a {type(value).__name__} as JSON; extras and iterator "
        "states must be JSON values (dict, list, str, int, float, bool, None, bytes)"
    )


def _check_array(value: Any, where: str) -> None:
    """What ``np.asarray`` cannot make a JSON value of, named at ``where`` (it raised
    jax's own TypeError or RuntimeError, naming no item): a PRNG key, a deleted array."""
    if not isinstance(value, jax.Array):
        return
    if value.is_deleted():
        raise StructureError(
            f"{where}: expected a live array, found one that was deleted (donated to a "
            f"jitted step, or .delete()d): store its value before the step donates it"
        )
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        raise StructureError(
            f"{where}: a PRNG key cannot be stored as JSON; keep it in the saved state "
            f"(state['rng'], restored as a key), or store jax.random.key_data(key)"
        )


def _utf8(text: str, where: str) -> str:
    """``text`` when UTF-8 encodes it; StructureError naming ``where`` otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StructureError(
            f"{where}: text that UTF-8 cannot encode: {e.reason} ({text[e.start : e.end]!r} "
            f"at character {e.start}); JSON items hold UTF-8 text only"
        ) from None
    return text


def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        if set(value) == {"__float__"} and value["__float__"] in ("nan", "inf", "-inf"):
            return float(value["__float__"])
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def read_json(directory: Location, name: str) -> Any:
    """JSON file ``name`` of an item of a committed step, checked against the checksum
    its step manifest records."""
    return _steps.read_item_json(directory, name)


def encode_json(value: Any, where: str) -> bytes:
    """The bytes of a JSON item (``to_json``'s output), within the reader's limits
    (``json_docs.JSON_ITEM``: StructureError naming ``where`` otherwise)."""
    return _docs.encode(value, where, _docs.JSON_ITEM, sort_keys=True)


def write_json(directory: Location, name: str, data: bytes) -> Written:
    """Writes the JSON bytes ``data`` (made durable by the step's sync); returns its
    checksum."""
    directory.write_bytes(name, data, durable=False)
    return Written(0, {name: _layout.sha256(data)})
