"""Serving params saved as an ``nnx.State`` (``{"params": nnx.state(model, nnx.Param)}``,
each leaf stored at ``<path>/value``) into an NNX like: an abstract module, the module
itself, or ``nnx.state`` of either. Every form raised a StructureError whose hint said
to pass ``like=nnx.state(model)``, which failed the same way; ``fop.restore`` and the
manager read the same step."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import flax_orbax_plugin as fop


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(3, 4, rngs=rngs)


def _values(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("saved_as", ["state_params", "state_all", "module"])
@pytest.mark.parametrize("like_form", ["abstract", "state_of_abstract", "module"])
def test_params_saved_as_an_nnx_state_serve_into_every_nnx_like(tmp_path, saved_as, like_form):
    model = Model(nnx.Rngs(0))
    saved = {
        "state_params": lambda: nnx.state(model, nnx.Param),
        "state_all": lambda: nnx.state(model),
        "module": lambda: model,
    }[saved_as]()
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, {"params": saved})
    like = {
        "abstract": lambda: nnx.eval_shape(lambda: Model(nnx.Rngs(1))),
        "state_of_abstract": lambda: nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(1)))),
        "module": lambda: Model(nnx.Rngs(5)),
    }[like_form]()
    got = fop.restore_params(tmp_path, like=like)
    want = _values(nnx.state(model, nnx.Param))
    found = _values(nnx.state(got) if isinstance(got, nnx.State) else got)
    assert len(found) == len(want)
    for a, b in zip(sorted(found, key=np.shape), sorted(want, key=np.shape), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_users_transform_is_kept_as_given(tmp_path):
    """The '/value' mapping is the reader's only when no transform is given: a user's
    transform is applied as written (here one that leaves '/value': like does not match)."""
    model = Model(nnx.Rngs(0))
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, {"params": nnx.state(model, nnx.Param)})
    like = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(1))))
    with pytest.raises(fop.StructureError, match=r"'dense/bias/value': unexpected key"):
        fop.restore_params(tmp_path, like=like, transform={r"^dense/": "dense/"})
    got = fop.restore_params(tmp_path, like=like, transform={r"/value$": ""})
    np.testing.assert_array_equal(got["dense"]["kernel"], np.asarray(model.dense.kernel))


def test_a_params_dataclass_like_serves_and_a_like_without_params_is_an_option_error(tmp_path):
    """``restore_params(like=params)`` for params that are a flax.struct dataclass was
    refused with a bare TypeError ("like of type P has no params"): the dataclass was
    split as a training state. An NNX optimizer (no params since flax 0.11) is an
    OptionTypeError saying what to pass, not a bare TypeError."""
    import jax.numpy as jnp
    import optax
    from flax import struct

    @struct.dataclass
    class Params:
        w: jax.Array
        b: jax.Array

    @struct.dataclass
    class State:
        step: jax.Array
        params: Params

    params = Params(jnp.arange(3.0), jnp.ones(2))
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, State(jnp.asarray(1), params))
    for like in (Params(jnp.zeros(3), jnp.zeros(2)), jax.eval_shape(lambda: params)):
        served = fop.restore_params(tmp_path, like=like)
        assert isinstance(served, Params)
        for got, want in zip(_values(served), _values(params), strict=True):
            np.testing.assert_array_equal(got, want)
    optimizer = nnx.Optimizer(Model(nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(fop.OptionTypeError, match=r"Optimizer, which holds no nnx.Param.*pass"):
        fop.restore_params(tmp_path, like=optimizer)
