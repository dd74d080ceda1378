"""The example's model (a Linen MLP), its training state, and a params digest."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state


class MLP(nn.Module):
    hidden_sizes: Sequence[int]
    num_classes: int

    @nn.compact
    def __call__(self, x):
        for width in self.hidden_sizes:
            x = nn.gelu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


def make_model(config, num_classes: int) -> MLP:
    return MLP(hidden_sizes=tuple(config.hidden_sizes), num_classes=num_classes)


def create_train_state(config, model: MLP, num_features: int) -> train_state.TrainState:
    """A fresh Linen TrainState: params from `config.seed`, Adam with cosine decay."""
    params = model.init(jax.random.key(config.seed), jnp.zeros((1, num_features)))["params"]
    schedule = optax.cosine_decay_schedule(config.learning_rate, config.num_train_steps)
    tx = optax.adam(schedule)
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def abstract_params(config, model: MLP, num_features: int):
    """The params' shapes and dtypes (jax.ShapeDtypeStruct), computed without allocating."""
    init = lambda: model.init(jax.random.key(0), jnp.zeros((1, num_features)))["params"]
    return jax.eval_shape(init)


def params_digest(params) -> str:
    """sha256 over every leaf's path, dtype, shape and bytes: equal digests, equal params."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
