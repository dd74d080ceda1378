"""Resuming params, step and the rest while starting the optimizer fresh (``reset``)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import flax_orbax_plugin as fop
from flax_orbax_plugin._state.iterators import StepIndexedIterator
from flax_orbax_plugin._state.resume import items_to_restore


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))


def make_state(tx):
    net = Net()
    params = net.init(jax.random.key(0), jnp.zeros((1, 3)))["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)


def batch_at(index):
    rng = np.random.default_rng(index)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    return {"x": x, "y": (x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]}


@jax.jit
def train_step(state, batch):
    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))


def train_with_adam(directory, steps=6):
    it = StepIndexedIterator(batch_at)
    cb = fop.CheckpointCallback(directory, every_steps=3, resume=True)
    state = cb.on_train_start(make_state(optax.adam(1e-2)), data_iterator=it)
    for step in range(1, steps + 1):
        state = train_step(state, next(it))
        cb.on_step_end(step, state)
    cb.on_train_end(state)
    return state


def test_changed_optimizer_error_points_to_reset(tmp_path):
    train_with_adam(tmp_path)
    cb = fop.CheckpointCallback(tmp_path, resume=True)
    with pytest.raises(fop.StructureError) as info:
        cb.on_train_start(make_state(optax.sgd(0.1, momentum=0.9)))
    cb.close()
    message = str(info.value)
    assert "item 'opt_state' of step 6" in message
    assert "reset=('opt_state',)" in message
    # every option named is one the callback and the manager take (issue 25)
    assert "pass partial=True, missing='keep' or transform= to on_train_start" in message


def test_reset_opt_state_resumes_everything_else(tmp_path):
    trained = train_with_adam(tmp_path)
    fresh = make_state(optax.sgd(0.1, momentum=0.9))
    it = StepIndexedIterator(batch_at)
    cb = fop.CheckpointCallback(tmp_path, resume=True)
    state = cb.on_train_start(fresh, data_iterator=it, reset=("opt_state",))
    assert cb.resumed_step == 6 and int(state.step) == 6
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(trained.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert state.opt_state is fresh.opt_state and state.tx is fresh.tx  # the new optimizer
    assert it.get_state()["index"] == 6  # the data position is resumed too
    # Training goes on with the new optimizer and saves its (new) state.
    state = train_step(state, next(it))
    cb.on_step_end(7, state)
    cb.on_train_end(state)
    with fop.CheckpointManager(tmp_path) as mngr:
        again = mngr.restore(like=make_state(optax.sgd(0.1, momentum=0.9)))
    assert int(again.step) == 7
    np.testing.assert_array_equal(
        np.asarray(jax.tree.leaves(again.opt_state)[0]),
        np.asarray(jax.tree.leaves(state.opt_state)[0]),
    )


def test_reset_with_nnx_keeps_the_new_optimizer_in_place(tmp_path):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    grads = nnx.grad(lambda m: jnp.mean(m(jnp.ones((4, 3))) ** 2))(model)
    opt.update(model, grads)
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, (model, opt))

    model2 = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    opt2 = nnx.Optimizer(model2, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    cb = fop.CheckpointCallback(tmp_path, resume=True)
    out = cb.on_train_start((model2, opt2), reset=("opt_state",))
    cb.close()
    assert out[0] is model2 and out[1] is opt2
    np.testing.assert_array_equal(model2.kernel[...], model.kernel[...])
    assert int(opt2.step[...]) == 1  # the step is resumed
    momentum = jax.tree.leaves(nnx.to_pure_dict(nnx.state(opt2))["opt_state"])
    assert momentum and not any(np.any(np.asarray(m)) for m in momentum)  # fresh: zeros


def test_items_to_restore_checks_its_names():
    state = make_state(optax.adam(1e-2))
    assert items_to_restore(state, reset=("opt_state",)) == ["step", "params"]
    with pytest.raises(ValueError, match="reset names item 'opt'.*'opt_state'"):
        items_to_restore(state, reset=("opt",))
    with pytest.raises(ValueError, match="tuple of item names"):
        items_to_restore(state, reset="opt_state")


class _ScaledState(train_state.TrainState):
    dynamic_scale: Any = None
    batch_stats: Any = None


def test_a_state_field_that_is_none_where_the_step_holds_arrays_is_refused(tmp_path):
    """A TrainState whose dynamic_scale (or batch_stats) is None, resumed from a step that
    holds one, came back holding a dict of numpy arrays in that field (training then
    failed far away, or ran on with a dict); now a StructureError names the field, and
    reset= keeps it None on purpose."""
    from flax.training import dynamic_scale

    def make(**fields):
        return _ScaledState.create(
            apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1), **fields
        )

    saved = make(dynamic_scale=dynamic_scale.DynamicScale(), batch_stats={"m": jnp.ones(2)})
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, saved, extras={"loss": 0.5})
        with pytest.raises(fop.StructureError, match=r"'dynamic_scale' is None.*scale"):
            mngr.restore(like=make(batch_stats={"m": jnp.zeros(2)}))
        with pytest.warns(UserWarning, match="that like does not have"):  # a dict's None
            read = mngr.restore(like={"params": saved.params, "batch_stats": None})
        np.testing.assert_array_equal(read["batch_stats"]["m"], 1.0)  # is read as saved
        items = ("params", "extras")  # a JSON item under None is read as it is
        assert mngr.restore(like={"params": saved.params, "extras": None}, items=items)["extras"]
        with pytest.warns(UserWarning, match="that like does not have"):
            whole = mngr.restore(like={"extras": None, "params": saved.params})
        assert whole["extras"] == {"loss": 0.5}
    cb = fop.CheckpointCallback(tmp_path, resume=True)
    with pytest.raises(fop.StructureError, match="'dynamic_scale' is None"):
        cb.on_train_start(make(batch_stats={"m": jnp.zeros(2)}), reset=("opt_state",))
    cb = fop.CheckpointCallback(tmp_path, resume=True)
    state = cb.on_train_start(make(), reset=("dynamic_scale", "batch_stats"))
    cb.close()
    assert state.dynamic_scale is None and state.batch_stats is None
    np.testing.assert_array_equal(state.params["w"], saved.params["w"])
