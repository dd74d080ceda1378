"""Format version 1 is frozen: the golden checkpoints committed under tests/support/data/golden
(written by ``tests/support/golden.py``) restore bit for bit, verify clean, and keep the fields
FORMAT.md specifies. A change that breaks reading them fails here."""

import json
import os

import golden
import jax
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format import layout as _layout

G = golden.GOLDEN


def _same(expected, found, path="root"):
    if isinstance(expected, dict):
        assert isinstance(found, dict) and expected.keys() == found.keys(), path
        for k in expected:
            _same(expected[k], found[k], f"{path}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(found, (list, tuple)) and len(expected) == len(found), path
        for i, (e, f) in enumerate(zip(expected, found, strict=True)):
            _same(e, f, f"{path}/{i}")
    elif expected is None:
        assert found is None, path
    elif isinstance(expected, jax.Array) and jax.dtypes.issubdtype(
        expected.dtype, jax.dtypes.prng_key
    ):
        assert np.array_equal(jax.random.key_data(expected), jax.random.key_data(found)), path
    else:
        e, f = np.asarray(expected), np.asarray(found)
        assert e.dtype == f.dtype and e.shape == f.shape, (path, e.dtype, f.dtype)
        assert e.tobytes() == f.tobytes(), path
        assert type(expected) is type(found) or isinstance(found, np.ndarray), path


def test_every_leaf_kind_restores_bit_exact():
    want = golden.every_leaf_kind()
    _same(want, fop.restore(os.path.join(G, "leaf_kinds"), like=want))
    out = fop.restore(os.path.join(G, "leaf_kinds"))  # no template: numpy and Python values
    assert out["py_int"] == 2**40 + 3 and out["py_complex"] == 1 - 1j and out["none"] is None
    assert out["empty_dict"] == {} and out["empty_list"] == []
    np.testing.assert_array_equal(out["bf16"].view(np.uint16), want["bf16"].view(np.uint16))


def test_a_batch_of_small_leaves_restores_bit_exact():
    _same(golden.small_leaves(), fop.restore(os.path.join(G, "small_leaves")))


def test_linen_step_restores_bit_exact():
    want = golden.linen_state()
    mngr = fop.CheckpointManager(os.path.join(G, "linen"), read_only=True)
    got = mngr.restore(like=want)
    _same(want.params, got.params)
    _same(want.opt_state, got.opt_state)
    assert int(got.step) == int(want.step)
    assert mngr.restore(items="extras") == {"loss": 0.25}


def test_nnx_step_restores_bit_exact():
    from flax import nnx

    model, _ = golden.nnx_state()
    params = fop.restore_params(os.path.join(G, "nnx"))
    _same(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))), params)


def test_two_process_step_restores_into_one_process():
    d = os.path.join(G, "two_process")
    params = fop.restore_params(d)
    host = np.arange(48, dtype=np.float32).reshape(8, 6)
    np.testing.assert_array_equal(params["w"], host)
    np.testing.assert_array_equal(params["b"], host[0])
    mngr = fop.CheckpointManager(d, read_only=True)
    # The iterator positions belong to 2 processes: restoring them in 1 is refused,
    # naming both counts and the ways out; everything else restores.
    with pytest.raises(fop.StructureError, match=r"saved by 2 process.*1 are restoring"):
        mngr.restore(items="data_iterator")


@pytest.mark.parametrize("name", ["leaf_kinds", "small_leaves", "linen", "nnx", "two_process"])
def test_golden_checkpoints_verify_clean(name):
    results = fop.verify(os.path.join(G, name), all_steps=True)
    assert results and all(r.ok for r in results), [r for r in results if not r.ok]


def test_format_version_and_fields_are_as_specified():
    meta = json.loads(open(os.path.join(G, "leaf_kinds", _layout.METADATA_FILE), "rb").read())
    assert meta["format"] == "flax_orbax_plugin" and meta["format_version"] == 1
    kinds = {r["kind"] for r in meta["leaves"]}
    assert kinds >= {
        "array",
        "none",
        "py_int",
        "py_float",
        "py_bool",
        "py_complex",
        "np_scalar",
        "prng_key",
        "empty_dict",
        "empty_list",
    }
    storages = {r["storage"]["type"] for r in meta["leaves"] if "storage" in r}
    assert storages == {"array", "batch"}
    manifest = json.loads(open(os.path.join(G, "linen", "1", _layout.MANIFEST_FILE), "rb").read())
    assert manifest["format"] == "flax_orbax_plugin/step" and manifest["version"] == 1
    assert set(manifest["items"]) >= {"params", "opt_state", "step", "extras"}
    assert "params/_METADATA.json" in manifest["files"]
