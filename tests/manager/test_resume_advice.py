"""Advice that leads somewhere: what an error tells the user to do works when followed,
on the first try.

* A model whose width changed: the params and the Adam moments that mirror them both
  no longer fit; the first message names both in one ``reset=``, and following it
  resumes (it named ``reset=('params',)``, then failed on opt_state).
* ``on_train_end(state)`` in a loop that did not keep ``state.step``: the message says
  the step came from ``state.step`` and that ``on_train_end(state, step=...)`` fixes
  it; following it saves the final step.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import flax_orbax_plugin as fop


def make_state(width: int):
    net = nn.Dense(width)
    params = net.init(jax.random.key(0), jnp.zeros((1, 3)))["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-2))


def test_a_wider_model_is_told_every_item_to_reset_at_once(tmp_path):
    with fop.CheckpointCallback(tmp_path, every_steps=1) as cb:
        state = cb.on_train_start(make_state(4))
        cb.on_step_end(1, state.replace(step=1))
    wider = make_state(8)
    cb = fop.CheckpointCallback(tmp_path, every_steps=1, resume=True)
    with pytest.raises(fop.StructureError) as e:
        cb.on_train_start(wider)
    message = str(e.value)
    assert "reset=('params', 'opt_state')" in message, message
    assert "reset=('params',)" not in message, message
    assert "'opt_state' does not fit either" in message, message
    resumed = cb.on_train_start(wider, reset=("params", "opt_state"))  # as told: it works
    assert int(resumed.step) == 1 and cb.resumed_step == 1
    assert resumed.params["kernel"].shape == (3, 8)
    cb.on_train_end(resumed, step=2)


def test_one_item_that_does_not_fit_is_told_to_reset_it_alone(tmp_path):
    state = {"params": {"w": np.zeros(4)}, "buffers": {"b": np.ones(2)}}
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, state)
    changed = {"params": {"w": np.zeros(4)}, "buffers": {"b": np.ones(3)}}
    with fop.CheckpointManager(tmp_path) as mngr:
        with pytest.raises(fop.StructureError, match=r"reset=\('buffers',\)") as e:
            mngr.restore(like=changed)
    assert "fit either" not in str(e.value)  # params fits: not named


def test_on_train_end_with_a_stale_state_step_says_where_the_step_came_from(tmp_path):
    cb = fop.CheckpointCallback(tmp_path, every_steps=5)
    state = cb.on_train_start(make_state(4))  # a loop that never updates state.step
    for step in range(1, 11):
        cb.on_step_end(step, state)
    with pytest.raises(fop.CheckpointError) as e:
        cb.on_train_end(state)
    message = str(e.value)
    assert "state.step, which is 0" in message and "on_train_end(state, step=10)" in message
    cb.on_train_end(state, step=10)  # as told: the run ends, step 10 saved
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == [5, 10]
