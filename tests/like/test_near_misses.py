"""A like one level off what was saved says where the saved leaves are
(``_like.onto_like.near_miss``), on this library's checkpoints, Orbax's and Flax
msgpack files: the tree saved under a key (``params``), an NNX State's ``/value``
leaves restored into a plain dict, and the reverse (saved without ``/value``)."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx, serialization

import flax_orbax_plugin as fop

KERNEL = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_a_tree_saved_under_a_key(tmp_path):
    fop.save(tmp_path / "c", {"params": {"Dense_0": {"kernel": KERNEL}}})
    with pytest.raises(
        fop.StructureError,
        match=r"leaf 'Dense_0/kernel': .*it holds 'params/Dense_0/kernel': like is the tree "
        r"under 'params'",
    ):
        fop.restore(tmp_path / "c", {"Dense_0": {"kernel": KERNEL}})


def test_saved_without_nnx_value_leaves(tmp_path):
    fop.save(tmp_path / "c", {"kernel": KERNEL})
    like = {"kernel": {"value": np.zeros_like(KERNEL)}}
    with pytest.raises(fop.StructureError, match=r"it holds 'kernel': saved without NNX's"):
        fop.restore(tmp_path / "c", like)
    got = fop.restore(tmp_path / "c", like, transform={r"$": "/value"})  # the advice works
    np.testing.assert_array_equal(got["kernel"]["value"], KERNEL)


def test_an_nnx_state_saved_by_orbax_restored_into_a_plain_dict(tmp_path):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "nnx", nnx.state(model))
    checkpointer.wait_until_finished()
    plain = {"bias": np.zeros(3, np.float32), "kernel": np.zeros((2, 3), np.float32)}
    with pytest.raises(
        fop.StructureError,
        match=r"it holds 'bias/value': an NNX State's leaves, restored into "
        r"like=nnx\.state\(model\)",
    ):
        fop.restore(tmp_path / "nnx", plain)
    got = fop.restore(tmp_path / "nnx", nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(1))))
    np.testing.assert_array_equal(got["kernel"][...], model.kernel[...])  # the advice works


def test_a_msgpack_state_saved_under_params(tmp_path):
    path = tmp_path / "checkpoint_1"
    path.write_bytes(serialization.to_bytes({"params": {"kernel": KERNEL}}))
    with pytest.raises(fop.StructureError, match=r"like is the tree under 'params'"):
        fop.restore_msgpack(path, {"kernel": KERNEL})


def test_no_words_where_nothing_is_near(tmp_path):
    fop.save(tmp_path / "c", {"kernel": KERNEL})
    with pytest.raises(fop.StructureError) as caught:
        fop.restore(tmp_path / "c", {"bias": KERNEL}, partial=True)
    assert "it holds" not in str(caught.value)


def test_linen_state_params_given_to_a_managers_restore_says_how_to_pass_it(tmp_path):
    """Linen's ``state.params`` is ``{'params': {...}}`` itself; a manager reads a dict
    like as ``{item: like}``, so its 'params' entry is taken one level down. The words
    now say so and how to pass it; the advice restores."""
    params = {"params": {"Dense_0": {"kernel": KERNEL}}}
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": params})
        mngr.wait()
        with pytest.raises(fop.StructureError, match=r"pass like=\{'params': state\.params\}"):
            mngr.restore(params, items="params")
        got = mngr.restore({"params": params}, items="params")
    np.testing.assert_array_equal(got["params"]["Dense_0"]["kernel"], KERNEL)
