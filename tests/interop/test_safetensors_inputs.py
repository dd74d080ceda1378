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
