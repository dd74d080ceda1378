"""Resuming a training state into a changed layout with ``surgery=`` (issue 51 item 7).

Each surgery operation had to match in every item restored, and Adam's moments under
``opt_state`` (which mirror params) matched none, so only ``items="params"`` or
``reset=("opt_state",)`` worked, though the callback's docstring promises surgery for
resuming into a changed model. The operations now apply to params as given and, in
the other items, at every prefix that mirrors params (``0/mu/``, ``0/nu/``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import flax_orbax_plugin as fop

N, D = 3, 4


def _per_layer_state():
    params = {f"layers_{i}": {"kernel": jnp.full((D, D), i + 1.0)} for i in range(N)}
    params["head"] = jnp.arange(D * 2, dtype=jnp.float32).reshape(D, 2)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.1))
    grads = jax.tree.map(lambda x: x * 0.5 + 1.0, params)
    return state.apply_gradients(grads=grads)  # nonzero moments, step 1


def _scanned_state():
    params = {"scan": {"kernel": jnp.zeros((N, D, D))}, "head_t": jnp.zeros((2, D))}
    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(0.1))


SURGERY = [
    fop.Stack("scan/", "layers_{i}/"),
    fop.Rename("head", "head_t"),
    fop.Transpose("head_t", (1, 0)),
]


def _check(resumed, saved):
    want = {
        "scan": {"kernel": np.stack([saved[f"layers_{i}"]["kernel"] for i in range(N)])},
        "head_t": np.asarray(saved["head"]).T,
    }
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, resumed), want)


def test_the_callback_resumes_an_adam_train_state_through_surgery(tmp_path):
    saved = _per_layer_state()
    cb = fop.CheckpointCallback(tmp_path / "run")
    cb.on_train_start(saved)
    cb.on_train_end(saved, step=1)
    cb = fop.CheckpointCallback(tmp_path / "run", resume=True)
    resumed = cb.on_train_start(_scanned_state(), surgery=SURGERY)
    cb.close()
    assert int(resumed.step) == 1
    _check(resumed.params, saved.params)
    adam, saved_adam = resumed.opt_state[0], saved.opt_state[0]
    _check(adam.mu, saved_adam.mu)  # the moments followed their parameters
    _check(adam.nu, saved_adam.nu)
    assert int(adam.count) == int(saved_adam.count) == 1
    # and the resumed state trains on: the moments have the new layout's shapes
    grads = jax.tree.map(jnp.ones_like, resumed.params)
    resumed.apply_gradients(grads=grads)


def test_an_op_that_matches_nothing_in_params_is_still_refused(tmp_path):
    saved = _per_layer_state()
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, saved)
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        with pytest.raises(fop.StructureError, match="absent"):
            mngr.restore(like=_scanned_state(), surgery=[*SURGERY, fop.Transpose("absent", (1, 0))])
