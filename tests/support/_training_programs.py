"""Small real training programs, run as a subprocess by tests/end_to_end/test_training_loops.py.

Usage::

    python tests/support/_training_programs.py DIRECTORY FORM[,FORM...] [--resume] [--hang-at STEP]

Trains every named form of training state in lockstep for ``NUM_STEPS`` steps,
each with its own CheckpointCallback (``DIRECTORY/FORM``, a save every
``EVERY`` steps, async) and its own StepIndexedIterator. It prints
``step N`` after each step, ``resumed FORM N`` after a resume, and
``final FORM SHA256`` (a digest of every array of the final state: params,
optimizer, statistics, RNG keys and counts) at the end. ``--hang-at STEP``
stands for a slow step: after printing ``hang`` the program sleeps, so the test
can SIGKILL it mid-run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import flax_orbax_plugin as fop
from flax_orbax_plugin._state.train_state import split_state

NUM_STEPS = 10
EVERY = 4


def make_batch(index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([3, index])
    x = rng.normal(size=(8, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 0.0], np.float32))[:, None]
    return {"x": x, "y": y}


# ------------------------------------------------------------------ Linen


class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(nn.relu(x))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))


class ResNetLikeState(train_state.TrainState):
    """The shape of Flax's ImageNet example state."""

    batch_stats: Any = None
    dynamic_scale: Any = None


def make_linen_bn_ds():
    model = LinenBN()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 4)), train=False)
    return ResNetLikeState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adam(1e-2),
        batch_stats=variables["batch_stats"],
        dynamic_scale=dynamic_scale_lib.DynamicScale(),
    )


@jax.jit
def linen_bn_ds_step(state, batch):
    def loss_fn(params):
        out, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["x"],
            train=True,
            mutable=["batch_stats"],
        )
        return jnp.mean((out - batch["y"]) ** 2), updates

    dyn, is_fin, (_, updates), grads = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True)(
        state.params
    )
    new = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    new = new.replace(
        opt_state=jax.tree.map(
            lambda a, b: jnp.where(is_fin, a, b), new.opt_state, state.opt_state
        ),
        params=jax.tree.map(lambda a, b: jnp.where(is_fin, a, b), new.params, state.params),
        dynamic_scale=dyn,
    )
    return new


def make_linen_sgd_none():
    """A TrainState with plain optax.sgd (no optimizer arrays) and a None field."""
    model = LinenMLP()
    params = model.init(jax.random.key(1), jnp.zeros((1, 4)))["params"]
    return ResNetLikeState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.05))


@jax.jit
def linen_plain_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))


# ------------------------------------------------------------------ NNX


class NNXNet(nnx.Module):
    """BatchNorm, and a Dropout drawing from the Rngs passed at call time."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, *, rngs: nnx.Rngs | None = None):
        x = nnx.relu(self.bn(self.l1(x)))
        if rngs is not None:
            x = self.drop(x, rngs=rngs)
        return self.l2(x)


class NNXOwnStreams(nnx.Module):
    """A Dropout carrying its own RNG stream (the module's state holds key and count)."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, *, rngs: nnx.Rngs | None = None):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def _nnx_loss(model, batch, rngs):
    return jnp.mean((model(batch["x"], rngs=rngs) - batch["y"]) ** 2)


@nnx.jit
def nnx_step(model, optimizer, batch):
    optimizer.update(model, nnx.grad(_nnx_loss)(model, batch, None))


@nnx.jit
def nnx_dropout_step(model, optimizer, rngs, batch):
    optimizer.update(model, nnx.grad(_nnx_loss)(model, batch, rngs))


@nnx.jit
def nnx_mao_step(mao, batch):
    mao.update(nnx.grad(_nnx_loss)(mao.model, batch, None))


def _pair(tx):
    model = NNXNet(nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


class Form:
    """A training state and its train step: ``state = step(state, batch)``."""

    def __init__(self, make, step):
        self.make, self.step = make, step


def _nnx_pair_step(state, batch):
    nnx_step(*state, batch)
    return state


def _nnx_dropout_step(state, batch):
    nnx_dropout_step(*state, batch)
    return state


def _nnx_dict_step(state, batch):
    nnx_dropout_step(state["model"], state["optimizer"], state["rngs"], batch)
    return state


def _nnx_mao_step(state, batch):
    nnx_mao_step(state, batch)
    return state


def _nnx_mao():
    return nnx.ModelAndOptimizer(NNXNet(nnx.Rngs(0)), optax.adam(1e-2))


def _nnx_own_streams():
    model = NNXOwnStreams(nnx.Rngs(0, dropout=4))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _nnx_dict():
    model, optimizer = _pair(optax.adam(1e-2))
    return {"model": model, "optimizer": optimizer, "rngs": nnx.Rngs(dropout=5)}


FORMS = {
    "linen_bn_ds": Form(make_linen_bn_ds, linen_bn_ds_step),
    "linen_sgd_none": Form(make_linen_sgd_none, linen_plain_step),
    "nnx_pair": Form(lambda: _pair(optax.adam(1e-2)), _nnx_pair_step),
    "nnx_sgd": Form(lambda: _pair(optax.sgd(0.05)), _nnx_pair_step),
    "nnx_dropout": Form(
        lambda: (*_pair(optax.adamw(1e-2)), nnx.Rngs(dropout=3)), _nnx_dropout_step
    ),
    "nnx_own_streams": Form(_nnx_own_streams, _nnx_pair_step),
    "nnx_mao": Form(_nnx_mao, _nnx_mao_step),
    "nnx_dict": Form(_nnx_dict, _nnx_dict_step),
}


def digest(state) -> str:
    h = hashlib.sha256()
    items = split_state(state)
    for name in sorted(items):
        for path, leaf in jax.tree_util.tree_leaves_with_path(items[name]):
            if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            arr = np.asarray(leaf)
            h.update(f"{name}{jax.tree_util.keystr(path)}{arr.dtype}{arr.shape}".encode())
            h.update(arr.tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("forms")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--hang-at", type=int, default=None)
    args = parser.parse_args()

    runs = {}
    for name in args.forms.split(","):
        form = FORMS[name]
        it = fop.StepIndexedIterator(make_batch)
        cb = fop.CheckpointCallback(
            os.path.join(args.directory, name), every_steps=EVERY, keep=2, resume=args.resume
        )
        state = cb.on_train_start(form.make(), data_iterator=it)
        if cb.resumed_step is not None:
            print(f"resumed {name} {cb.resumed_step}", flush=True)
        runs[name] = [form, it, cb, state, cb.resumed_step or 0]

    for step in range(1, NUM_STEPS + 1):
        for run in runs.values():
            form, it, cb, state, start = run
            if step <= start:
                continue
            run[3] = state = form.step(state, next(it))
            cb.on_step_end(step, state)
        print(f"step {step}", flush=True)
        if step == args.hang_at:
            print("hang", flush=True)
            time.sleep(120)

    for name, (_, _, cb, state, _) in runs.items():
        cb.on_train_end(state, step=NUM_STEPS)
        print(f"final {name} {digest(state)}", flush=True)


if __name__ == "__main__":
    main()
