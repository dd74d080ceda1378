"""Split/merge of Linen TrainState (and subclasses) and Flax NNX objects."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

from flax_orbax_plugin._state.train_state import merge_state, split_state


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(2)(x)


class TrainStateBN(train_state.TrainState):
    batch_stats: Any = None
    ema_params: Any = None


def _host_leaf(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
    return np.asarray(x)


def to_host(tree):
    """numpy copies of every leaf (typed PRNG keys stay jax arrays)."""
    return jax.tree.map(_host_leaf, tree)


def make_linen_state():
    model = MLP()
    variables = model.init(jax.random.key(0), jnp.ones((1, 4)))
    return TrainStateBN.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adamw(1e-3),
        batch_stats=variables["batch_stats"],
        ema_params=jax.tree.map(jnp.copy, variables["params"]),
    )


def test_linen_split_names_every_pytree_field_and_no_static_field():
    state = make_linen_state()
    items = split_state(state)
    assert set(items) == {"step", "params", "opt_state", "batch_stats", "ema_params"}
    assert "apply_fn" not in items and "tx" not in items
    assert items["params"] is state.params


def test_linen_merge_takes_static_fields_from_like():
    state = make_linen_state()
    abstract = jax.eval_shape(lambda: make_linen_state())
    restored = to_host(split_state(state))
    merged = merge_state(abstract, restored)
    assert merged.apply_fn is abstract.apply_fn and merged.tx is abstract.tx
    np.testing.assert_array_equal(
        merged.params["Dense_0"]["kernel"], state.params["Dense_0"]["kernel"]
    )
    np.testing.assert_array_equal(
        merged.batch_stats["BatchNorm_0"]["mean"], state.batch_stats["BatchNorm_0"]["mean"]
    )


def test_linen_partial_merge_keeps_the_rest_of_like():
    state = make_linen_state()
    new_params = jax.tree.map(lambda x: x + 1, state.params)
    merged = merge_state(state, {"params": new_params})
    assert merged.opt_state is state.opt_state
    assert merged.params is new_params


def test_dict_state_and_none():
    assert split_state({"params": 1, "extras": 2}) == {"params": 1, "extras": 2}
    assert merge_state({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}
    assert merge_state(None, {"b": 3}) == {"b": 3}
    assert split_state(None) == {}


def test_unsupported_state_is_a_clear_error():
    with pytest.raises(TypeError, match="cannot split a int"):
        split_state(3)


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.rngs = rngs

    def __call__(self, x):
        x = self.bn(self.l1(x))
        for b in self.blocks:
            x = b(x)
        return x


def test_nnx_module_and_optimizer_split_merge():
    model = NNXModel(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    items = split_state((model, opt))
    assert set(items) == {"params", "rng", "model_state", "opt_state", "step"}
    assert "mean" in items["model_state"]["bn"]
    assert "tx" not in items

    # Train a step so the values differ from a fresh model.
    def loss(m):
        return jnp.mean(m(jnp.ones((2, 4))) ** 2)

    grads = nnx.grad(loss)(model)
    opt.update(model, grads)
    trained = to_host(split_state((model, opt)))

    model2 = NNXModel(nnx.Rngs(1))
    opt2 = nnx.Optimizer(model2, optax.adam(1e-2), wrt=nnx.Param)
    out = merge_state((model2, opt2), trained)
    assert out[0] is model2 and out[1] is opt2
    np.testing.assert_array_equal(model2.l1.kernel[...], model.l1.kernel[...])
    np.testing.assert_array_equal(model2.blocks[1].bias[...], model.blocks[1].bias[...])
    assert int(opt2.step[...]) == 1
    np.testing.assert_array_equal(
        jax.tree.leaves(opt2.opt_state)[1], jax.tree.leaves(opt.opt_state)[1]
    )


def test_nnx_state_split_merge():
    model = NNXModel(nnx.Rngs(0))
    state = nnx.state(model)
    items = split_state(state)
    assert set(items) == {"params", "rng", "model_state"}
    other = nnx.state(NNXModel(nnx.Rngs(5)))
    merged = merge_state(other, to_host(items))
    assert isinstance(merged, nnx.State)
    np.testing.assert_array_equal(merged["l1"]["kernel"][...], model.l1.kernel[...])


# ---------------------------------------------------------------- NNX forms, end to end


class DropoutModel(nnx.Module):
    """Dropout without streams of its own: Rngs are passed at call time."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x, *, rngs=None):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def _nnx_train(model, opt, rngs=None, steps=2):
    def loss(m, r):
        if isinstance(m, DropoutModel):
            return jnp.mean(m(jnp.ones((2, 4)), rngs=r) ** 2)
        return jnp.mean(m(jnp.ones((2, 4))) ** 2)

    for _ in range(steps):
        grads = nnx.grad(loss)(model, rngs)
        if isinstance(opt, nnx.ModelAndOptimizer):
            opt.update(grads)
        else:
            opt.update(model, grads)


def _leaves(*objs):
    out = []
    for o in objs:
        for leaf in jax.tree.leaves(nnx.state(o)):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            out.append(np.asarray(leaf))
    return out


def assert_same(a, b):
    la, lb = _leaves(*a), _leaves(*b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


def test_nnx_rngs_at_call_time_round_trip_in_place(tmp_path):
    import flax_orbax_plugin as fop

    model = DropoutModel(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    rngs = nnx.Rngs(dropout=7)
    _nnx_train(model, opt, rngs)
    items = split_state((model, opt, rngs))
    assert set(items) == {"params", "step", "opt_state", "rngs"}
    assert int(items["rngs"]["dropout"]["count"]) == 2  # two dropout draws so far
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(2, (model, opt, rngs))

    model2 = DropoutModel(nnx.Rngs(1))
    opt2 = nnx.Optimizer(model2, optax.adam(1e-2), wrt=nnx.Param)
    rngs2 = nnx.Rngs(dropout=99)
    with fop.CheckpointManager(tmp_path) as mngr:
        out = mngr.restore(like=(model2, opt2, rngs2))
    assert out[0] is model2 and out[1] is opt2 and out[2] is rngs2
    assert_same((model, opt, rngs), (model2, opt2, rngs2))
    # The resumed run draws the same dropout masks: it does not diverge.
    _nnx_train(model, opt, rngs)
    _nnx_train(model2, opt2, rngs2)
    assert_same((model, opt, rngs), (model2, opt2, rngs2))
    np.testing.assert_array_equal(
        fop.restore_params(tmp_path, like=model2)["l1"]["kernel"],
        np.asarray(items["params"]["l1"]["kernel"]),
    )


def test_nnx_model_and_optimizer_writes_params(tmp_path):
    import flax_orbax_plugin as fop

    model = NNXModel(nnx.Rngs(0))
    mao = nnx.ModelAndOptimizer(model, optax.adam(1e-2))
    _nnx_train(mao.model, mao)
    items = split_state(mao)
    assert set(items) == {"params", "rng", "model_state", "step", "opt_state"}
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, mao)
    other = nnx.ModelAndOptimizer(NNXModel(nnx.Rngs(3)), optax.adam(1e-2))
    with fop.CheckpointManager(tmp_path) as mngr:
        assert mngr.restore(like=other) is other
    assert_same((mao,), (other,))
    params = fop.restore_params(tmp_path, like=other)
    np.testing.assert_array_equal(params["l1"]["kernel"], np.asarray(model.l1.kernel[...]))
    abstract = nnx.eval_shape(lambda: NNXModel(nnx.Rngs(0)))  # allocates nothing
    params = fop.restore_params(tmp_path, like=abstract)
    assert isinstance(params["l1"]["kernel"], jax.Array)
    np.testing.assert_array_equal(params["l1"]["kernel"], np.asarray(model.l1.kernel[...]))


def test_nnx_dict_form_writes_params_and_keeps_other_items(tmp_path):
    import flax_orbax_plugin as fop

    def make(seed):
        model = DropoutModel(nnx.Rngs(seed))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        ema = nnx.state(DropoutModel(nnx.Rngs(seed + 10)), nnx.Param)
        return {"model": model, "optimizer": opt, "rngs": nnx.Rngs(dropout=seed), "ema": ema}

    state = make(0)
    _nnx_train(state["model"], state["optimizer"], state["rngs"])
    assert set(split_state(state)) == {"params", "step", "opt_state", "rngs", "ema"}
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(2, state)
    like = make(5)
    with fop.CheckpointManager(tmp_path) as mngr:
        out = mngr.restore(like=like)
    assert out["model"] is like["model"] and out["optimizer"] is like["optimizer"]
    assert_same(
        (state["model"], state["optimizer"], state["rngs"]),
        (out["model"], out["optimizer"], out["rngs"]),
    )
    np.testing.assert_array_equal(
        out["ema"]["l1"]["kernel"][...], state["ema"]["l1"]["kernel"][...]
    )
    # restore_params takes the params of a dict like, too.
    params = fop.restore_params(tmp_path, like=make(9))
    np.testing.assert_array_equal(params["l2"]["bias"], np.asarray(state["model"].l2.bias[...]))


def test_unsupported_element_is_named_with_its_position():
    model = DropoutModel(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"state\[2\]: expected an nnx.Module, .* found int"):
        split_state((model, opt, 3))
    with pytest.raises(TypeError, match=r"state\[0\] and state\[1\] both provide item 'params'"):
        split_state((model, DropoutModel(nnx.Rngs(1))))
    with pytest.raises(TypeError, match=r"state\['a'\] and state\['b'\] both provide item 'rngs'"):
        split_state({"a": nnx.Rngs(0), "b": nnx.Rngs(1)})


def test_optimizer_without_arrays_still_has_an_opt_state():
    model = DropoutModel(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
    assert split_state(opt)["opt_state"] == {}
    state = train_state.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1)
    )
    assert jax.tree.leaves(split_state(state)["opt_state"]) == []


def test_items_without_arrays_round_trip_linen(tmp_path):
    import flax_orbax_plugin as fop

    class State(train_state.TrainState):
        dynamic_scale: Any = None

    def make(seed):
        return State.create(
            apply_fn=None, params={"w": jnp.full(2, float(seed))}, tx=optax.sgd(0.1)
        )

    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, make(1))
    with fop.CheckpointManager(tmp_path) as mngr:
        out = mngr.restore(like=make(0))
        assert set(mngr.restore(items=None)) == {"step", "params", "opt_state", "dynamic_scale"}
    assert out.dynamic_scale is None
    assert out.opt_state == make(0).opt_state
    np.testing.assert_array_equal(out.params["w"], [1.0, 1.0])


def test_items_without_arrays_round_trip_nnx(tmp_path):
    import flax_orbax_plugin as fop

    def make(seed):
        model = DropoutModel(nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    saved = make(1)
    _nnx_train(*saved, rngs=nnx.Rngs(dropout=0))
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, saved)
    like = make(0)
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.restore(like=like)
        assert set(mngr.restore(items=None)) == {"step", "params", "opt_state"}
    assert_same(saved, like)


def test_fop_restore_into_an_nnx_module_restores_it_in_place(tmp_path):
    """README: NNX objects 'are restored in place'. The manager did; ``fop.restore``
    returned a new module and left ``like`` at its random init (a caller that did not
    assign the result trained from scratch). An nnx.State like is a value, returned."""
    import flax_orbax_plugin as fop

    saved = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    fop.save(tmp_path / "s", nnx.state(saved))
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(2))
    assert fop.restore(tmp_path / "s", like=model) is model
    np.testing.assert_array_equal(model.kernel[...], saved.kernel[...])
    np.testing.assert_array_equal(model.bias[...], saved.bias[...])
    state = fop.restore(tmp_path / "s", like=nnx.state(nnx.Linear(3, 4, rngs=nnx.Rngs(5))))
    np.testing.assert_array_equal(state["kernel"][...], saved.kernel[...])


def test_fop_restore_into_a_tuple_or_dict_of_nnx_objects_restores_each_in_place(tmp_path):
    """``fop.restore(path, (model, optimizer))`` returned new objects and left the given
    model and optimizer at their fresh init, while one module alone was restored in
    place: a caller that did not assign the result trained from scratch, silently."""
    import flax_orbax_plugin as fop

    def make(seed):
        model = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    saved = make(0)
    _nnx_train(*saved)
    fop.save(tmp_path / "t", saved)
    fop.save(tmp_path / "d", {"model": saved[0], "opt": saved[1], "w": jnp.arange(3.0)})

    like = make(2)
    assert fop.restore(tmp_path / "t", like=like) is like
    assert_same(saved, like)

    model, opt = make(3)
    out = fop.restore(tmp_path / "d", like={"model": model, "opt": opt, "w": jnp.zeros(3)})
    assert out["model"] is model and out["opt"] is opt
    assert_same(saved, (model, opt))
    np.testing.assert_array_equal(out["w"], np.arange(3.0))
