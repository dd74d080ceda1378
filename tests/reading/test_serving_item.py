"""restore_params(item=) serves another pytree item than params: an EMA copy saved
beside them (``ema_params``), the one a diffusion or language model is served from.
Before, only ``params`` could be served; another item needed its step number spelt
into a path (``fop.restore(<dir>/<step>/ema_params)``)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import flax_orbax_plugin as fop


class EmaState(train_state.TrainState):
    ema_params: dict


def _run(tmp_path):
    params = {"w": np.arange(4, dtype=np.float32)}
    ema = {"w": np.full(4, 0.5, np.float32)}
    state = EmaState.create(apply_fn=None, params=params, tx=optax.sgd(0.1), ema_params=ema)
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(3, state, extras={"loss": 1.0})
    return state, tmp_path / "run"


def test_another_item_is_served_with_item(tmp_path):
    state, run = _run(tmp_path)
    got = fop.restore_params(run, item="ema_params")
    np.testing.assert_array_equal(got["w"], state.ema_params["w"])
    like = jax.eval_shape(lambda: state.ema_params)
    np.testing.assert_array_equal(fop.restore_params(run, like, item="ema_params")["w"], 0.5)
    on_state = fop.restore_params(run, jax.eval_shape(lambda: state), item="ema_params")
    np.testing.assert_array_equal(on_state["w"], 0.5)  # the state's field of that name
    np.testing.assert_array_equal(fop.restore_params(run)["w"], state.params["w"])


def test_an_item_that_is_not_there_or_no_pytree_is_named(tmp_path):
    _, run = _run(tmp_path)
    with pytest.raises(
        fop.CheckpointNotFoundError, match=r"no ema item \(its items: .*'ema_params'"
    ):
        fop.restore_params(run, item="ema")
    with pytest.raises(fop.CheckpointError, match=r"item 'extras' .* is a json item, not a pytree"):
        fop.restore_params(run, item="extras")
    with pytest.raises(fop.OptionTypeError, match=r"^item must be"):
        fop.restore_params(run, item=3)


def test_item_on_an_orbax_checkpoint_is_refused_with_what_reads_it(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(1, args=ocp.args.StandardSave({"params": {"w": np.ones(2, np.float32)}}))
        mngr.wait_until_finished()
    with pytest.raises(fop.CheckpointError, match=r"Orbax checkpoint: item='ema_params'"):
        fop.restore_params(tmp_path / "orbax", item="ema_params")
    np.testing.assert_array_equal(fop.restore_params(tmp_path / "orbax")["w"], 1.0)
