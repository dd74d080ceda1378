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

from flax_orbax_plugin._train_state import merge_state, split_state


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
