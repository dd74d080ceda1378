"""When restore may cast a saved leaf to another dtype: never when a value changes.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.casting``.

The policy (``"safe"`` or ``"unsafe"``) is an argument of every check: a restore's
``ReadRequest.cast``, carried by each of its targets. Threading: no state; any thread.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import ml_dtypes
import numpy as np

from .._base.option_spec import flag, outside_stacklevel
from .._base.tree import encode_key, path_string
from .._errors import OptionError, StructureError

CAST_POLICIES = ("safe", "unsafe")


def _category(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "bool"
    if dtype.kind == "c":
        return "complex"
    if dtype.kind == "f" or _is_ml_float(dtype):
        return "float"
    if dtype.kind in "iu" or _is_ml_int(dtype):
        return "int"
    return "other"


def _is_ml_float(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.finfo(dtype)
    except (ValueError, TypeError):
        return False
    return dtype.kind == "V"


def _is_ml_int(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.iinfo(dtype)
    except (ValueError, TypeError):
        return False
    return True


def _first(values: np.ndarray, bad: np.ndarray | None = None) -> Any:
    flat = values.reshape(-1)
    if bad is not None:
        index = int(np.argmax(bad.reshape(-1)))
        return flat[index].item() if flat.dtype.kind in "biufc" else float(flat[index])
    if flat.size == 0:
        return None
    return flat[0].item() if flat.dtype.kind in "biufc" else float(flat[0])


def _changed(values: np.ndarray, changed: np.ndarray) -> Any:
    """The first value marked ``changed``, or None when none is."""
    return _first(values, changed) if changed.any() else None


ADVICE = "pass cast='unsafe' to cast anyway"  # the end of each refusal (readers' own: onto_like)


def with_advice(error: StructureError, advice: str) -> str:
    """A refusal of :func:`check` with another way out at its end than ``cast='unsafe'``
    (a caller whose option has another name: a reader's, ``HFShards``, the CLI's flag)."""
    return str(error).replace(ADVICE, advice)


def _fail(path: str, src: np.dtype, dst: np.dtype, why: str, example: Any) -> StructureError:
    shown = "" if example is None else f" (e.g. {example!r})"
    return StructureError(f"leaf {path!r}: saved as {src}, requested {dst}: {why}{shown}; {ADVICE}")


def _float_changes(x: np.ndarray, dst: np.dtype) -> np.ndarray | None:
    """Mask of float values that a cast to ``dst`` turns into something other than a
    rounding (finite to inf/NaN, inf to NaN or finite, NaN to a number, a finite value
    past ``dst``'s range: a dtype without inf (float4, float6) saturates it to its
    largest value); None if none."""
    orig = x if x.dtype.kind == "f" else x.astype(np.float32)  # ml_dtypes floats
    back = x.astype(dst).astype(orig.dtype)
    finite = np.isfinite(orig)
    bad = finite & ~np.isfinite(back)
    bad |= finite & (np.abs(orig.astype(np.float64)) >= _overflow_at(dst))
    if not finite.all():  # inf must stay the same inf, NaN stay NaN
        nan = np.isnan(orig)
        bad |= (nan & ~np.isnan(back)) | (~finite & ~nan & (back != orig))
    return bad if bad.any() else None


@functools.lru_cache(maxsize=64)
def _holds_bools(dst: np.dtype) -> bool:
    """Whether 0 and 1 are values of ``dst`` (float8_e8m0fnu, powers of two only, has
    no 0)."""
    with np.errstate(all="ignore"):
        back = np.array([0, 1], np.uint8).astype(dst).astype(np.float64)
    return back.tolist() == [0.0, 1.0]


def _overflow_at(dst: np.dtype) -> float:
    """The magnitude from which a value rounds past ``dst``'s largest finite value (its
    largest plus half a step there, where round-to-nearest-even leaves the range)."""
    info = ml_dtypes.finfo(dst)
    largest = float(info.max)
    return largest + 2.0 ** (np.floor(np.log2(largest)) - int(info.nmant)) / 2


def check_tree(host: Any, target: Any, *, cast: str) -> None:
    """:func:`check` for every leaf of ``host`` (numpy values) against the dtype of the
    matching leaf of ``target`` (arrays or ShapeDtypeStructs of the same structure)."""

    def one(keypath, x, t):
        # str, bytes and None leaves pass through (no dtype to cast to or from)
        if x is not None and not isinstance(x, str | bytes) and hasattr(t, "dtype"):
            path = path_string([encode_key(k) for k in keypath])
            check(path, np.asarray(x), t.dtype, cast=cast)

    jax.tree_util.tree_map_with_path(one, host, target, is_leaf=lambda x: x is None)


def check_policy(cast: Any) -> str:
    """``cast=`` where it enters (restore, restore_params, the exporter, a request):
    one of :data:`CAST_POLICIES`, else an OptionError naming it."""
    if cast not in CAST_POLICIES:
        raise OptionError(f"cast must be one of {CAST_POLICIES}, found {cast!r:.60}")
    return cast


def legacy_cast(cast: Any, allow_cast: Any, *, where: str) -> str:
    """``cast=`` of an entry point that took ``allow_cast=`` in earlier releases
    (``from_safetensors``, ``restore_orbax``): the policy, checked; ``allow_cast=``
    given (True or False) still works this release, with a DeprecationWarning naming
    ``cast=``; both given is an OptionError."""
    check_policy(cast)
    if allow_cast is None:
        return cast
    allow_cast = flag("allow_cast", allow_cast)  # True or False (numpy's too), else said
    if cast != "safe":
        raise OptionError(f"{where}: cast= and allow_cast= given together; cast= alone")
    new = "unsafe" if allow_cast else "safe"
    warnings.warn(
        f"{where}(allow_cast={allow_cast}) is deprecated: write cast={new!r}, as restore "
        f"and restore_params take it",
        DeprecationWarning,
        stacklevel=outside_stacklevel(),
    )
    return new


def check(path: str, host: np.ndarray, out_dtype: Any, *, cast: str = "safe") -> None:
    """Raises StructureError if casting ``host`` (a leaf's saved data) to ``out_dtype``
    would change a value beyond float rounding; a no-op under ``cast="unsafe"``."""
    src, dst = np.dtype(host.dtype), np.dtype(out_dtype)
    check_policy(cast)
    if src == dst or cast == "unsafe":
        return
    a, b = _category(src), _category(dst)
    if a == "bool":
        if b == "other":
            raise _fail(path, src, dst, "no cast from bool to this dtype", _first(host))
        if _holds_bools(dst):
            return  # False/True are 0/1
        bad = ~host.astype(np.bool_) if host.size else None
        if bad is not None and bad.any():  # float8_e8m0fnu has no 0: False would be NaN
            raise _fail(path, src, dst, "this dtype has no 0 (False)", _first(host, bad))
        return
    # Refused by dtype, whatever the values; the example shown is a value the cast would
    # change (none when every value would survive it: the rule is still the dtype's).
    with np.errstate(all="ignore"):
        if b == "bool":
            why = "a cast to bool is refused (it turns every nonzero value into True)"
            raise _fail(path, src, dst, why, _changed(host, (host != 0) & (host != 1)))
        if a == "complex" and b != "complex":
            why = "a cast from complex to real is refused (it drops the imaginary part)"
            raise _fail(path, src, dst, why, _changed(host, np.imag(host) != 0))
        if a == "float" and b == "int":
            why = "a cast from float to integer is refused (it truncates)"
            wide = host.astype(np.float64)  # (ml_dtypes floats too)
            raise _fail(path, src, dst, why, _changed(host, ~np.isfinite(wide) | (wide % 1 != 0)))
    if "other" in (a, b):
        raise _fail(path, src, dst, "no checked cast between these dtypes", None)
    with np.errstate(all="ignore"):
        if a == "int":
            values = host.astype(np.int64) if src.kind == "V" else host  # int4/uint4
            if b == "int":
                _check_int_range(path, values, src, dst)
            else:
                _check_int_exact(path, values, src, dst, np.finfo(dst).dtype)
            return
        # float or complex to float or complex: rounding only
        parts = (np.real(host), np.imag(host)) if a == "complex" else (host,)
        target = np.finfo(dst).dtype if b == "complex" else dst
        for part in parts:
            part = np.asarray(part)
            bad = _float_changes(part, target)
            if bad is not None:
                raise _fail(
                    path, src, dst, "a value overflows or is not representable", _first(part, bad)
                )


def _iinfo(dtype: np.dtype):
    try:
        return np.iinfo(dtype)
    except ValueError:
        return ml_dtypes.iinfo(dtype)


def _check_int_range(path: str, values: np.ndarray, src: np.dtype, dst: np.dtype) -> None:
    have, want = np.iinfo(values.dtype), _iinfo(dst)
    lo, hi = max(int(want.min), int(have.min)), min(int(want.max), int(have.max))
    if lo == int(have.min) and hi == int(have.max):
        return  # every value of the saved dtype fits
    bad = (values < lo) | (values > hi)
    if bad.any():
        why = "a value does not fit and would wrap around"
        raise _fail(path, src, dst, why, _first(values, bad))


def _check_int_exact(path, values: np.ndarray, src, dst, real: np.dtype) -> None:
    back = values.astype(real).astype(np.float64)
    bad = ~np.isfinite(back)
    if values.dtype.itemsize < 8:  # float64 holds every such integer exactly
        bad |= back != values.astype(np.float64)
    else:
        lo, hi = (0.0, 2.0**64) if values.dtype.kind == "u" else (-(2.0**63), 2.0**63)
        inside = (back >= lo) & (back < hi)
        bad |= ~inside
        bad |= np.where(inside, back, 0).astype(values.dtype) != values
    if bad.any():
        raise _fail(path, src, dst, "an integer is not exactly representable", _first(values, bad))
