"""``fop.to_safetensors`` / ``fop.from_safetensors``: what they refuse, and how: the
library's errors naming the option or the leaf, at the entry (never numpy's or jax's
raw error from deep inside, nor a late one)."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

import flax_orbax_plugin as fop


def _placeable(dtype) -> bool:
    try:
        jax.device_put(np.zeros((), dtype), jax.devices()[0])
    except Exception:  # noqa: BLE001  (jax's error is what the reader explains)
        return False
    return True


def test_a_dtype_jax_cannot_place_is_restores_structure_error(tmp_path):
    """A raw 'JaxRuntimeError: INVALID_ARGUMENT: Unknown NumPy dtype' before."""
    f6 = ml_dtypes.float6_e2m3fn
    if _placeable(f6):
        pytest.skip("this backend places float6")
    out = tmp_path / "f6.safetensors"
    fop.to_safetensors({"x": np.zeros(8, f6)}, out)
    like = {"x": jax.ShapeDtypeStruct((8,), f6)}
    with pytest.raises(fop.StructureError, match="leaf 'x': jax cannot place a float6_e2m3fn"):
        fop.from_safetensors(str(out), like=like)
    back = fop.from_safetensors(str(out), like={"x": np.zeros(8, f6)})  # to the host: fine
    assert back["x"].dtype == f6


def test_to_safetensors_checks_its_options_at_the_entry(tmp_path):
    """force='no' overwrote; progress=5, metadata='x', dtype='bf16' were raw Python or
    numpy errors; {'a': None} was written as the text 'None'."""
    params = {"w": np.ones(3, np.float32)}
    out = tmp_path / "a.safetensors"
    fop.to_safetensors(params, out)
    before = out.read_bytes()
    for flag in ("no", 1, "True"):
        with pytest.raises(fop.OptionTypeError, match="force must be True or False"):
            fop.to_safetensors({"w": np.zeros(3, np.float32)}, out, force=flag)
    assert out.read_bytes() == before  # never overwritten
    fop.to_safetensors(params, out, force=np.True_)  # numpy's bool is a bool
    new = tmp_path / "b.safetensors"
    bad = [
        (dict(progress=5), fop.OptionTypeError, "progress must be a callable or None"),
        (dict(metadata="x"), fop.OptionTypeError, "metadata: expected a dict of str to str"),
        (dict(metadata={"a": None}), fop.OptionTypeError, "the entry 'a': NoneType None"),
        (dict(metadata={1: "x"}), fop.OptionTypeError, "the entry 1"),
        (dict(dtype="bf16"), fop.OptionTypeError, "dtype: expected a floating dtype"),
        (dict(dtype="int8"), fop.OptionError, "dtype: expected a floating dtype"),
        (dict(transpose_kernels="yes"), fop.OptionTypeError, "transpose_kernels must be"),
    ]
    for options, error, text in bad:
        with pytest.raises(error, match=text):
            fop.to_safetensors(params, new, **options)
    assert not new.exists()
    fop.to_safetensors(params, new, max_shard_size=np.int64(1000))  # numpy's int is an int
    assert new.exists()


def test_from_safetensors_refuses_an_empty_list_of_files():
    """It read nothing and gave {}."""
    with pytest.raises(fop.OptionError, match="paths_or_index: .* found an empty list"):
        fop.from_safetensors([])
