"""The quick-start snippets of README.md and docs/ run as they are written, on a first
start.

Every ```python block of README.md and of the documentation pages carries a marker on
the line before it (``tests/support/_docs.py``); those marked
``<!-- snippet: first-start ... -->`` run here, verbatim, with small real objects for
the names the text around them supplies: ``state``, ``it``, ``train_step`` ... The
two-tier snippet (docs/tiers.md) raised CheckpointNotFoundError on a first start.
Each first-start snippet is then run again as the restart it stands for, which must
resume.

The only text replaced is the two-tier snippet's places (``/local/ssd/run1``,
``gs://bucket/run1``): a temporary directory, and a bucket of the GCS test server or
a shared-filesystem path (the snippet's comment names both).
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import _docs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state

import flax_orbax_plugin as fop

pytest_plugins = ["_servers"]

NUM_STEPS = 4


def snippets() -> list[tuple[str, str]]:
    """``(how, code)`` of every python block of README.md and the docs, in order."""
    return [(b.how, b.code) for page in _docs.pages() for b in _docs.blocks(page)]


def first_start(containing: str) -> str:
    (code,) = [c for how, c in snippets() if how.startswith("first-start") and containing in c]
    return code


def test_every_python_block_is_marked_and_every_first_start_one_runs_here():
    hows = [how for how, _ in snippets()]
    assert len(hows) >= 7
    for how in hows:
        assert how == "run" or how.startswith(("first-start", "run by ", "not run (")), how
    keys = ("CheckpointCallback(config", "nnx.Optimizer(model", "persistent=")
    readme = [b.code for b in _docs.blocks("README.md") if b.how.startswith("first-start")]
    assert all(any(k in c for c in readme) for k in keys[:2])  # the quick start
    ours = [c for how, c in snippets() if how.startswith("first-start")]
    assert len(ours) == len(keys) and all(any(k in c for c in ours) for k in keys)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def batch_at(index):
    rng = np.random.default_rng(index)
    return {"x": rng.normal(size=(4, 3)).astype(np.float32)}


# -- Quick start, Linen ------------------------------------------------------------------


class Net(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(1)(linen.tanh(linen.Dense(4)(x)))


def init_params():
    return Net().init(jax.random.key(0), jnp.zeros((1, 3)))["params"]


@jax.jit
def linen_step(state, batch):
    loss = lambda p: jnp.mean(state.apply_fn({"params": p}, batch["x"]) ** 2)
    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def run_linen(directory, resume):
    state = train_state.TrainState.create(
        apply_fn=Net().apply, params=init_params(), tx=optax.adam(1e-2)
    )
    config = SimpleNamespace(checkpoint=SimpleNamespace(directory=str(directory), resume=resume))
    names = dict(config=config, state=state, it=fop.StepIndexedIterator(batch_at), jax=jax)
    names.update(train_step=linen_step, num_steps=NUM_STEPS, directory=str(directory))
    names.update(init_params=init_params)
    exec(compile(first_start("CheckpointCallback(config"), "<snippet>", "exec"), names)
    return names


@pytest.mark.parametrize("resume", [True, False])
def test_quick_start_linen(tmp_path, resume):
    first = run_linen(tmp_path / "run", resume)
    assert int(first["state"].step) == NUM_STEPS and first["cb"].resumed_step is None
    assert_trees_equal(first["params"], first["state"].params)  # served: the last step
    if resume:  # the same command again: the restart resumes the last step
        again = run_linen(tmp_path / "run", resume)
        assert again["cb"].resumed_step == NUM_STEPS
        assert_trees_equal(again["state"].params, first["state"].params)


# -- Quick start, NNX ---------------------------------------------------------------------


class Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 1, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.dropout(self.linear(x), rngs=rngs)


@nnx.jit
def nnx_step(model, optimizer, rngs, batch):
    grads = nnx.grad(lambda m, r: jnp.mean(m(batch["x"], rngs=r) ** 2))(model, rngs)
    optimizer.update(model, grads)


def run_nnx(directory):
    cb = fop.CheckpointCallback(directory, every_steps=2, resume=True)
    names = dict(fop=fop, Model=Model, nnx=nnx, optax=optax, cb=cb)
    names.update(it=fop.StepIndexedIterator(batch_at))
    names.update(train_step=nnx_step, num_steps=NUM_STEPS, directory=str(directory))
    exec(compile(first_start("nnx.Optimizer(model"), "<snippet>", "exec"), names)
    return names


def test_quick_start_nnx(tmp_path):
    first = run_nnx(tmp_path / "run")
    assert int(first["optimizer"].step[...]) == NUM_STEPS and first["cb"].resumed_step is None
    trained = nnx.to_pure_dict(nnx.state(first["model"], nnx.Param))
    assert_trees_equal(first["params"], trained)
    again = run_nnx(tmp_path / "run")
    assert again["cb"].resumed_step == NUM_STEPS
    assert_trees_equal(nnx.to_pure_dict(nnx.state(again["model"], nnx.Param)), trained)


# -- Two tiers ----------------------------------------------------------------------------


def run_tiers(local, remote, state):
    code = first_start("persistent=")
    for place, ours in (("/local/ssd/run1", str(local)), ("gs://bucket/run1", remote)):
        assert f'"{place}"' in code, place
        code = code.replace(f'"{place}"', repr(ours))
    names = {"fop": fop, "state": state}
    exec(compile(code, "<snippet>", "exec"), names)
    return names["state"]


def fresh_state():
    return {"params": {"w": np.zeros(3, np.float32)}, "opt_state": {"mu": np.zeros(3)}}


def check_two_tiers(tmp_path, remote):
    local = tmp_path / "ssd" / "run1"
    state = fresh_state()
    assert run_tiers(local, remote, state) is state  # a first start: fresh, no error
    trained = {"params": {"w": np.arange(3, dtype=np.float32)}, "opt_state": {"mu": np.ones(3)}}
    with fop.CheckpointManager(local, persistent=remote, async_save=False) as mngr:
        mngr.save(10, trained)
    shutil.rmtree(local)  # a new machine: its local disk is empty, the bucket holds step 10
    assert_trees_equal(run_tiers(local, remote, fresh_state()), trained)


def test_two_tiers_on_gcs(tmp_path, gcs_location):
    check_two_tiers(tmp_path, gcs_location.url)


def test_two_tiers_on_a_shared_filesystem(tmp_path):
    check_two_tiers(tmp_path, str(tmp_path / "shared" / "run1"))
