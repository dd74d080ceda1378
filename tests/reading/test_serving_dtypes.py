"""Serving with ``dtype=`` / ``sharding=`` over the dtypes a user brings: a numpy like
stays numpy on the host with its own integer dtypes (it became device arrays, its int64
made int32: refused, or wrapped under cast='unsafe'); a 64-bit leaf placed on devices
without jax_enable_x64 is checked before it is narrowed, never wrapped silently."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import flax_orbax_plugin as fop

pytestmark = pytest.mark.skipif(jax.config.jax_enable_x64, reason="jax holds 64-bit here")

BIG = 2**40  # an int64 that int32 cannot hold


@pytest.fixture
def saved(tmp_path):
    params = {"w": np.array([1.1, 2.0], np.float32), "i": np.array([BIG, 1], np.int64)}
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, {"params": params})
    return tmp_path, params


@pytest.mark.parametrize("cast", ["safe", "unsafe"])
def test_a_numpy_like_with_dtype_stays_numpy_with_its_integer_dtypes(saved, cast):
    directory, params = saved
    like = {"w": np.zeros(2, np.float32), "i": np.zeros(2, np.int64)}
    got = fop.restore_params(directory, like=like, dtype=jnp.bfloat16, cast=cast)
    assert type(got["w"]) is np.ndarray and got["w"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["w"], params["w"].astype(ml_dtypes.bfloat16))
    assert type(got["i"]) is np.ndarray and got["i"].dtype == np.int64
    np.testing.assert_array_equal(got["i"], params["i"])
