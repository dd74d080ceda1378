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


def test_sharding_without_like_refuses_an_int64_that_int32_cannot_hold(saved, devices):
    directory, params = saved
    one = jax.sharding.SingleDeviceSharding(devices[3])
    for options in ({"sharding": one}, {"sharding": one, "dtype": jnp.bfloat16}):
        with pytest.raises(fop.StructureError, match=r"leaf 'i': saved as int64, requested int32"):
            fop.restore_params(directory, **options)  # was placed wrapped: [0, 1]
    wrapped = fop.restore_params(directory, sharding=one, cast="unsafe")["i"]  # asked for
    assert wrapped.dtype == jnp.int32 and wrapped.sharding == one


def test_sharding_without_like_places_what_int32_holds(tmp_path, devices):
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, {"params": {"i": np.array([-5, 7], np.int64), "f": np.float64(1.5)}})
    one = jax.sharding.SingleDeviceSharding(devices[2])
    got = fop.restore_params(tmp_path, sharding=one)
    assert got["i"].dtype == jnp.int32 and got["i"].sharding == one
    np.testing.assert_array_equal(np.asarray(got["i"]), [-5, 7])
    assert got["f"].dtype == jnp.float32 and float(got["f"]) == 1.5


@pytest.fixture
def orbax_run(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": np.array([1.1, 1e5], np.float32), "i": np.array([BIG, 1], np.int64)}
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
        mngr.wait_until_finished()
    return tmp_path / "run", params


def test_orbax_dtype_rounds_but_refuses_overflow_and_wrap_as_native_does(orbax_run):
    directory, params = orbax_run
    # dtype= cast every leaf unchecked here: 1e5 became inf in float16, 2**40 became 0
    with pytest.raises(fop.StructureError, match=r"leaf 'w': .*float16: a value overflows"):
        fop.restore_params(directory, like={"w": params["w"]}, partial=True, dtype=jnp.float16)
    like = {
        "w": jax.ShapeDtypeStruct((2,), jnp.float32),
        "i": jax.ShapeDtypeStruct((2,), jnp.int32),
    }
    with pytest.raises(fop.StructureError, match=r"leaf 'i': saved as int64, requested int32"):
        fop.restore_params(directory, like=like, dtype=jnp.bfloat16)
    host = {"w": np.zeros(2, np.float32), "i": np.zeros(2, np.int64)}
    got = fop.restore_params(directory, like=host, dtype=jnp.bfloat16)  # rounding: asked for
    np.testing.assert_array_equal(got["w"], params["w"].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(got["i"], params["i"])
    unsafe = fop.restore_params(directory, like=host, dtype=jnp.float16, cast="unsafe")
    assert np.isinf(unsafe["w"][1])  # numpy's cast, opted into
