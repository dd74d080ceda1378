"""A resume's warnings name what the caller's entry point takes.

Resuming a step that holds HF shards (``fop.HFShards``: a copy of params, read only
when named) warned that ``like`` lacks the item ``hf`` and said to name ``items=``,
which ``CheckpointCallback.on_train_start`` does not take. A copy item is never warned
about; an item the state really lacks is, with advice each entry point can follow.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import flax_orbax_plugin as fop


def _state(value: float = 1.0):
    return train_state.TrainState.create(
        apply_fn=None, params={"w": jnp.full(4, value)}, tx=optax.sgd(0.1)
    )


def test_resuming_a_step_with_hf_shards_warns_nothing(tmp_path):
    run = tmp_path / "run"
    cb = fop.CheckpointCallback(run, manager_options={"hf_shards": fop.HFShards(every_steps=1)})
    state = cb.on_train_start(_state(2.0))
    cb.on_step_end(1, state)
    cb.on_train_end(state, step=1)
    assert (run / "1" / "hf").is_dir()  # the step holds the shards
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cb = fop.CheckpointCallback(run, resume=True)
        resumed = cb.on_train_start(_state(0.0))
        cb.close()
        with fop.CheckpointManager(run) as mngr:
            mngr.restore(like=_state(0.0))
    assert [str(w.message) for w in caught if "does not have" in str(w.message)] == []
    np.testing.assert_array_equal(resumed.params["w"], np.full(4, 2.0))


def test_an_item_the_state_lacks_gets_advice_the_callback_can_follow(tmp_path):
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, {"params": {"w": jnp.ones(4)}, "batch_stats": {"m": jnp.ones(2)}})
    cb = fop.CheckpointCallback(run, resume=True)
    with pytest.warns(UserWarning, match=r"\['batch_stats'\].*partial=True.*on_train_start"):
        cb.on_train_start({"params": {"w": jnp.zeros(4)}})
    cb.close()
    cb = fop.CheckpointCallback(run, resume=True)  # the advice, followed: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = cb.on_train_start({"params": {"w": jnp.zeros(4)}}, partial=True)
    cb.close()
    np.testing.assert_array_equal(got["params"]["w"], np.ones(4))
