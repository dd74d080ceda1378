"""restore_params says which step it served (an INFO line): a serving loop that also
asks latest_step() while a writer commits could otherwise report another step."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import flax_orbax_plugin as fop


def test_restore_params_logs_the_step_it_served(tmp_path, caplog):
    with fop.CheckpointManager(tmp_path, async_save=False) as m:
        for step in (3, 8):
            m.save(step, {"params": {"w": np.full(2, step, np.float32)}})
    with caplog.at_level(logging.INFO, logger="flax_orbax_plugin"):
        got = fop.restore_params(tmp_path)
        fop.restore_params(tmp_path, step=3)
    assert got["w"][0] == 8
    assert f"restore_params: step 8 of {tmp_path}" in caplog.text
    assert f"restore_params: step 3 of {tmp_path}" in caplog.text


def test_a_like_holding_params_at_its_top_gets_the_hint(tmp_path):
    """model.init's output ({'params': ...}) given whole as like: the error says so."""
    params = {"Dense_0": {"kernel": np.ones((2, 2)), "bias": np.zeros(2)}}
    with fop.CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, {"params": params})
    with pytest.raises(fop.StructureError, match=r"like\['params'\]"):
        fop.restore_params(tmp_path, like={"params": params})
    fop.restore_params(tmp_path, like=params)


def test_a_variables_like_names_its_other_collections_as_items(tmp_path):
    """A BatchNorm model's variables ({'params', 'batch_stats'}) given as like: the
    hint said only like['params'], not where batch_stats, which serving needs too, is."""
    params, stats = {"w": np.ones(2, np.float32)}, {"mean": np.zeros(2, np.float32)}
    with fop.CheckpointManager(tmp_path, async_save=False) as m:
        m.save(1, {"params": params, "batch_stats": stats})
    with pytest.raises(
        fop.StructureError, match=r"\['batch_stats'\] are items.*1' \+ '/batch_stats'"
    ):
        fop.restore_params(tmp_path, like={"params": params, "batch_stats": stats})
    np.testing.assert_array_equal(
        fop.restore(tmp_path / "1" / "batch_stats")["mean"], stats["mean"]
    )


def test_a_damaged_latest_step_names_the_older_steps_to_serve(tmp_path):
    """The damage was raised with no word of the good steps before it."""
    from _files import flip_byte

    with fop.CheckpointManager(tmp_path / "run") as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"params": {"w": np.full(64, step, np.float32)}})
    data = tmp_path / "run" / "3" / "params" / "data"
    flip_byte(next(p for p in data.iterdir() if p.suffix == ".bin"))
    with pytest.raises(fop.CorruptCheckpointError) as caught:
        fop.restore_params(tmp_path / "run")
    assert "older steps of" in " ".join(caught.value.__notes__)
    assert "[1, 2]; restore_params(..., step=2)" in " ".join(caught.value.__notes__)
    served = fop.restore_params(tmp_path / "run", step=2)
    np.testing.assert_array_equal(served["w"], np.full(64, 2, np.float32))


def test_a_step_without_params_names_the_items_it_holds(tmp_path):
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"weights": {"w": np.ones(3, np.float32)}})
    with pytest.raises(fop.CheckpointNotFoundError, match=r"its items: \['weights'\]"):
        fop.restore_params(tmp_path / "run")
    got = fop.restore(str(tmp_path / "run" / "1" / "weights"))
    np.testing.assert_array_equal(got["w"], np.ones(3, np.float32))


def test_an_nnx_state_like_serves_this_librarys_nnx_run(tmp_path):
    """nnx.state(model, nnx.Param) (or nnx.split's state, or its eval_shape) as like
    failed on the library's own NNX run ('a/bias/value' ... saved without NNX's
    '/value'); like=model worked. It is served as a State of like's structure now."""
    import jax
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(2, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, rngs=rngs)

    saved = Model(nnx.Rngs(0))
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, saved)
    fresh = Model(nnx.Rngs(1))
    for like in (
        nnx.state(fresh, nnx.Param),
        nnx.split(fresh, nnx.Param, ...)[1],
        jax.eval_shape(lambda: nnx.state(fresh, nnx.Param)),
    ):
        got = fop.restore_params(tmp_path / "run", like=like)
        assert isinstance(got, nnx.State)
        np.testing.assert_array_equal(got["a"]["kernel"][...], saved.a.kernel[...])
        np.testing.assert_array_equal(got["bn"]["scale"][...], saved.bn.scale[...])
    nnx.update(fresh, got)  # the served params go into a model as they are
    np.testing.assert_array_equal(fresh.a.bias[...], saved.a.bias[...])
