"""The cast rules over every dtype of the table (low-bit ones too): a cast restore makes
without ``cast="unsafe"`` is a rounding or an error, never another value."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import StructureError
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._like import onto_like as _casting

NAMES = sorted(_layout.DTYPES)


def _samples(name: str) -> np.ndarray:
    """Every bit pattern of a type of at most 8 bits; numbers across the range else."""
    dtype = _layout.dtype_from_name(name)
    bits = _layout.DTYPES[name].bits
    if name == "bool":
        return np.array([False, True])
    if bits <= 8:
        return np.arange(1 << bits).astype(np.uint8).view(dtype)
    edges = [0, 1, -1, 3, 7, 100, 255, 1000, 65504, 70000, 1 << 20, 3e38, -3e38, 1e300]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        inside = [v for v in edges if info.min <= v <= info.max]
        return np.array([*inside, info.min, info.max], dtype)
    extra = [np.nan, np.inf, -np.inf, 1e-30, 0.1, 6.5, 6.9, 7.0, 448.0, 470.0]
    with np.errstate(all="ignore"):
        return np.array(edges + extra, np.float64).astype(dtype)


def _as_float(x: np.ndarray) -> np.ndarray:
    if x.dtype.kind == "c":
        return x.real.astype(np.float64)
    return x.astype(np.float64)


def _is_rounding(orig: np.ndarray, back: np.ndarray, dst: np.dtype) -> np.ndarray:
    """Per element: ``back`` (a value cast to ``dst`` and back) is ``orig`` rounded."""
    if dst == np.bool_ or _casting._category(dst) == "int":
        return back == orig
    info = ml_dtypes.finfo(np.finfo(dst).dtype if dst.kind == "c" else dst)
    rel = 2.0 ** -int(info.nmant)
    tiny = float(info.smallest_subnormal) if hasattr(info, "smallest_subnormal") else 0.0
    tiny = max(tiny, float(info.smallest_normal) * rel)
    with np.errstate(all="ignore"):
        near = np.abs(back - orig) <= np.abs(orig) * rel + 2 * tiny
        near |= np.abs(orig) < 2 * float(info.smallest_normal)  # underflow: rounded to 0
    same_special = (np.isnan(orig) & np.isnan(back)) | (np.isinf(orig) & (back == orig))
    return np.where(np.isfinite(orig), np.isfinite(back) & near, same_special)


@pytest.mark.parametrize("src", NAMES)
def test_a_cast_allowed_is_a_rounding(src):
    host = _samples(src)
    for dst_name in NAMES:
        dst = _layout.dtype_from_name(dst_name)
        try:
            _casting.check("leaf", host, dst)
        except StructureError as e:
            assert "'leaf'" in str(e) and dst_name in str(e)
            continue
        with np.errstate(all="ignore"):
            back = host.astype(dst)
            if dst.kind == "c" and host.dtype.kind != "c":
                back = back.real
            orig, back = _as_float(host), _as_float(back)
        ok = _is_rounding(orig, back, dst)
        assert ok.all(), (src, dst_name, orig[~ok][:3], back[~ok][:3])


@pytest.mark.parametrize(
    "name,value",
    [("float4_e2m1fn", 100.0), ("float4_e2m1fn", 7.0), ("float6_e2m3fn", 20.0)]
    + [("float6_e3m2fn", 1e10), ("float8_e8m0fnu", -1.0), ("float8_e8m0fnu", 0.0)],
)
def test_restore_refuses_a_value_past_a_low_bit_dtype(tmp_path, name, value):
    """float4/float6 have no inf: numpy saturates a value past their range (100.0 -> 6.0);
    restore onto such a like refuses it, naming the leaf, unless cast='unsafe'."""
    path = str(tmp_path / "c")
    fop.save(path, {"w": np.array([1.0, value], np.float32)})
    dtype = _layout.dtype_from_name(name)
    like = {"w": np.zeros(2, dtype)}
    with pytest.raises(StructureError, match=rf"leaf 'w': saved as float32, requested {name}"):
        fop.restore(path, like=like)
    got = fop.restore(path, like=like, cast="unsafe")["w"]
    assert got.dtype == dtype


def test_restore_rounds_into_a_low_bit_dtype(tmp_path):
    path = str(tmp_path / "c")
    fop.save(path, {"w": np.array([0.5, 1.4, 6.9, -3.0], np.float32)})
    got = fop.restore(path, like={"w": np.zeros(4, ml_dtypes.float4_e2m1fn)})["w"]
    assert got.astype(np.float32).tolist() == [0.5, 1.5, 6.0, -3.0]
