"""Restore never changes a value by a cast unless asked to (issue 11, point 6).

Float narrowing rounds (allowed: serving in half precision); overflow, wraparound,
float to int, anything to bool, complex to real and int to float that loses
integers raise StructureError naming the leaf, the dtypes and a value, unless
``cast="unsafe"``."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop


def roundtrip(tmp_path, saved, requested, *, cast="safe", name="x"):
    fop.save(tmp_path / "ckpt", {name: saved})
    like = {name: np.zeros(saved.shape, requested)}
    return fop.restore(tmp_path / "ckpt", like, cast=cast)[name]


def assert_same(actual, expected):
    """Bit-for-bit the same values (NaN equals NaN, also in ml_dtypes' float types)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype
    if actual.dtype.kind == "V":  # bfloat16, float8, int4: compare exactly when widened
        wide = np.float64 if "float" in actual.dtype.name else np.int64
        actual, expected = actual.astype(wide), expected.astype(wide)
    np.testing.assert_array_equal(actual, expected)


REFUSED = [
    # (saved values, requested dtype, message fragment, offending value shown)
    (np.array([1, 16777217], np.int32), np.float32, "not exactly representable", "16777217"),
    (np.array([1.0, 1e5], np.float32), np.float16, "overflows", "100000.0"),
    (np.array([3, 300], np.int64), np.int8, "wrap around", "300"),
    (np.array([-1, 2], np.int32), np.uint32, "wrap around", "-1"),
    (np.array([2.0, 2.7, np.nan], np.float32), np.int32, "float to integer", "2.7"),
    (np.array([0.5, 0.0], np.float32), np.bool_, "to bool", "0.5"),
    (np.array([0, 2], np.int32), np.bool_, "to bool", "2"),
    (np.array([1 + 0j, 1 + 2j], np.complex64), np.float32, "complex to real", "(1+2j)"),
    (np.array([1e300], np.float64), np.float32, "overflows", "1e+300"),
    (np.array([2**63 - 1], np.int64), np.float64, "not exactly representable", str(2**63 - 1)),
    (np.array([np.inf], np.float32), ml_dtypes.float8_e4m3fn, "overflows", "inf"),
]


@pytest.mark.parametrize("saved, requested, why, value", REFUSED)
def test_a_cast_that_changes_a_value_is_refused(tmp_path, saved, requested, why, value):
    with pytest.raises(fop.StructureError) as info:
        roundtrip(tmp_path, saved, requested, name="layer")
    msg = str(info.value)
    assert "'layer'" in msg and why in msg and value in msg
    assert saved.dtype.name in msg and np.dtype(requested).name in msg


@pytest.mark.parametrize("saved, requested, why, value", REFUSED)
def test_cast_unsafe_casts_as_numpy_does(tmp_path, saved, requested, why, value):
    out = roundtrip(tmp_path, saved, requested, cast="unsafe")
    with np.errstate(all="ignore"):
        expected = saved.astype(requested)
    assert_same(out, expected)


ALLOWED = [
    (np.array([1.1, -2.3e-3, 65504.0, np.inf, -np.inf, np.nan], np.float32), np.float16),
    (np.array([1.1, 3e38, -np.inf, np.nan], np.float32), ml_dtypes.bfloat16),
    (np.array([1.1, 1e-300, 3e38], np.float64), np.float32),  # underflow rounds to 0
    (np.array([1 + 2j, 3e38j], np.complex128), np.complex64),
    (np.array([-128, 5, 127], np.int64), np.int8),
    (np.array([0, 2**31 - 1], np.int64), np.uint32),
    (np.array([16777216, -16777216, 3], np.int32), np.float32),
    (np.array([2**53, -(2**53)], np.int64), np.float64),
    (np.array([True, False]), np.float32),
    (np.array([True, False]), np.int8),
    (np.array([1.5, -2.0], np.float16), np.float64),
    (np.array([7, -8], np.int8), ml_dtypes.int4),
]


@pytest.mark.parametrize("saved, requested", ALLOWED)
def test_widening_fitting_and_float_rounding_are_allowed(tmp_path, saved, requested):
    assert_same(roundtrip(tmp_path, saved, requested), saved.astype(requested))


def test_like_of_python_and_numpy_scalars_is_checked_too(tmp_path):
    fop.save(tmp_path / "ckpt", {"step": 7, "lr": 0.5, "big": np.int64(300)})
    out = fop.restore(tmp_path / "ckpt", {"step": 0, "lr": 0.0, "big": np.int64(0)})
    assert out == {"step": 7, "lr": 0.5, "big": 300}
    with pytest.raises(fop.StructureError, match=r"'lr'.*float64.*int64"):
        fop.restore(tmp_path / "ckpt", {"step": 0, "lr": 0, "big": np.int64(0)})
    with pytest.raises(fop.StructureError, match=r"'big'.*int64.*int8.*300"):
        fop.restore(tmp_path / "ckpt", {"step": 0, "lr": 0.0, "big": np.int8(0)})


def test_leaf_by_leaf_batched_reads_are_checked(tmp_path):
    filler = np.zeros(200_000, np.float32)  # the wanted leaf is a small part of its batch
    fop.save(tmp_path / "ckpt", {"filler": filler, "x": np.array([1e5], np.float32)})
    like = {"x": jax.ShapeDtypeStruct((1,), np.float16)}
    with pytest.raises(fop.StructureError, match=r"'x'.*100000"):
        fop.restore(tmp_path / "ckpt", like, partial=True)


def test_sharded_reads_are_checked(tmp_path, devices):
    mesh = Mesh(np.array(devices), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    values = np.full((8, 4), 3.0, np.float32)
    values[5, 1] = 1e6  # overflows float16 in one shard only
    fop.save(tmp_path / "ckpt", {"w": jax.device_put(values, sharding)})
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float16, sharding=sharding)}
    with pytest.raises(fop.StructureError, match=r"'w'.*float32.*float16.*1000000"):
        fop.restore(tmp_path / "ckpt", like)
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=sharding)}
    out = fop.restore(tmp_path / "ckpt", like)["w"]
    assert out.sharding == sharding
    assert_same(out, values.astype(jnp.bfloat16))
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float16, sharding=sharding)}
    out = fop.restore(tmp_path / "ckpt", like, cast="unsafe")["w"]
    assert np.isinf(np.asarray(out)[5, 1])


def test_restore_params_dtype_rounds_but_never_overflows(tmp_path):
    params = {"dense": {"kernel": np.array([1.1, 2.2], np.float32)}}
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, {"params": params})
    for like in (None, params):
        out = fop.restore_params(tmp_path, like, dtype=jnp.bfloat16)
        assert_same(out["dense"]["kernel"], params["dense"]["kernel"].astype(jnp.bfloat16))
    params = {"dense": {"kernel": np.array([1.1, 7e4], np.float32)}}
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(2, {"params": params})
    for like in (None, params):
        with pytest.raises(fop.StructureError, match=r"dense/kernel.*float16.*70000"):
            fop.restore_params(tmp_path, like, dtype=jnp.float16)


def test_an_unknown_cast_policy_is_a_clear_error(tmp_path):
    fop.save(tmp_path / "ckpt", {"x": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match=r"cast must be one of \('safe', 'unsafe'\), found 'yes'"):
        fop.restore(tmp_path / "ckpt", cast="yes")
