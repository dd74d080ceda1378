"""An optax state holds field-less nodes (``EmptyState()``): a Flax msgpack file stores
one as ``{}``, an Orbax checkpoint as None. Both restore into a TrainState of the same
optimizer: ``restore_msgpack(like=state)`` raised for every optimizer, and an imported
Orbax TrainState could not be resumed into the TrainState it came from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import serialization
from flax.training import train_state

import flax_orbax_plugin as fop


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


def _state(tx, step=0):
    net = Net()
    params = net.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)
    return state.replace(step=step)


TXS = {"adam": optax.adam(0.1), "sgd": optax.sgd(0.1), "chain": optax.chain(optax.adamw(0.1))}


@pytest.mark.parametrize("name", sorted(TXS))
def test_restore_msgpack_into_a_trainstate_of_any_optimizer(tmp_path, name):
    saved = _state(TXS[name], step=9)
    (tmp_path / "checkpoint_9").write_bytes(serialization.to_bytes(saved))
    got = fop.restore_msgpack(tmp_path / "checkpoint_9", like=_state(TXS[name]))
    assert int(got.step) == 9
    assert jax.tree.structure(got.opt_state) == jax.tree.structure(saved.opt_state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_imported_orbax_trainstate_resumes_into_the_same_trainstate(tmp_path):
    saved = _state(optax.adam(0.1), step=7)
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(7, args=ocp.args.Composite(default=ocp.args.StandardSave(saved)))
        mngr.wait_until_finished()
    fop.import_orbax(tmp_path / "orbax", tmp_path / "ours")
    fresh = _state(optax.adam(0.1))
    cb = fop.CheckpointCallback(tmp_path / "ours", every_steps=1, resume=True)
    got = cb.on_train_start(fresh)
    cb.close()
    assert int(got.step) == 7
    assert jax.tree.structure(got.opt_state) == jax.tree.structure(fresh.opt_state)
    np.testing.assert_array_equal(
        got.params["Dense_0"]["kernel"], np.asarray(saved.params["Dense_0"]["kernel"])
    )


@pytest.mark.parametrize("name", sorted(TXS))
def test_an_orbax_trainstate_restores_into_its_own_structure(tmp_path, name):
    """Read straight from Orbax (no import): each EmptyState of like stays an EmptyState
    (Orbax saved it as None), so the result has like's structure, as Orbax's own."""
    saved = _state(TXS[name], step=7)
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(7, args=ocp.args.StandardSave(saved))
        mngr.wait_until_finished()
    like = _state(TXS[name])
    got = fop.restore(tmp_path / "orbax" / "7" / "default", like=like)
    assert jax.tree.structure(got) == jax.tree.structure(like)
    assert int(got.step) == 7


def test_an_orbax_checkpoint_follows_restores_cast_rules(tmp_path):
    """float to int was taken where the values were whole (native: never); cast="unsafe"
    was dropped on the Orbax path."""
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        tree = {"w": np.array([2.0, 3.0], np.float32), "v": np.array([2.5, 1e5], np.float32)}
        mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
        mngr.wait_until_finished()
    item = tmp_path / "orbax" / "1" / "params"
    like = {"w": jax.ShapeDtypeStruct((2,), jnp.int32), "v": jax.ShapeDtypeStruct((2,), jnp.int32)}
    with pytest.raises(fop.StructureError, match="float to integer"):
        fop.restore(item, like={"w": like["w"]}, partial=True)
    got = fop.restore(item, like=like, cast="unsafe")
    np.testing.assert_array_equal(np.asarray(got["w"]), [2, 3])
