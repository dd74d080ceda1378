"""Empty things round-trip (issue 11, points 5 and 12): zero-size leaves on every read
path, and trees or items without any array data, nested empty containers included."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop


def assert_same_tree(actual, expected):
    assert jax.tree_util.tree_structure(actual, is_leaf=lambda x: x is None) == (
        jax.tree_util.tree_structure(expected, is_leaf=lambda x: x is None)
    ), (actual, expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_array_equal(a, e)


# -- point 5: zero-size leaves -------------------------------------------------------------


def test_zero_size_leaves_read_with_their_whole_batch(tmp_path):
    # "a" sits at offset 0 and "b" right after it: the batch is read whole
    tree = {"a": np.zeros((0, 5), np.float32), "b": np.arange(3, dtype=np.float32)}
    fop.save(tmp_path / "ckpt", tree)
    assert_same_tree(fop.restore(tmp_path / "ckpt"), tree)
    assert_same_tree(fop.restore(tmp_path / "ckpt", tree), tree)


def test_zero_size_leaves_read_leaf_by_leaf(tmp_path):
    tree = {
        "filler": np.ones(100_000, np.float32),  # makes the wanted leaves a small part
        "z": np.zeros((0, 5), np.float32),
        "y": np.zeros((3, 0), np.float32),
    }
    fop.save(tmp_path / "ckpt", tree)
    like = {"z": np.zeros((0, 5), np.float32), "y": jax.ShapeDtypeStruct((3, 0), np.float32)}
    out = fop.restore(tmp_path / "ckpt", like, partial=True)
    assert isinstance(out["z"], np.ndarray) and out["z"].shape == (0, 5)
    assert isinstance(out["y"], jax.Array) and out["y"].shape == (3, 0)


def test_zero_size_sharded_leaves_read_as_arrays_and_onto_shardings(tmp_path, devices):
    mesh = Mesh(np.array(devices), ("x",))
    sharding = NamedSharding(mesh, P(None, "x"))
    tree = {"z": jax.device_put(np.zeros((0, 8), np.float32), sharding)}  # stored as an array
    fop.save(tmp_path / "ckpt", tree)
    plain = fop.restore(tmp_path / "ckpt")
    assert isinstance(plain["z"], np.ndarray) and plain["z"].shape == (0, 8)
    like = {"z": jax.ShapeDtypeStruct((0, 8), np.float32, sharding=sharding)}
    out = fop.restore(tmp_path / "ckpt", like)
    assert out["z"].shape == (0, 8) and out["z"].sharding == sharding


# -- point 12: trees and items without array data ------------------------------------------

EMPTY_FORMS = {
    "dict": ({}, {}),
    "list": ([], []),
    "tuple": ((), []),
    "none": (None, None),
    "dict_of_none": ({"a": None}, {"a": None}),
    "optax_sgd": (optax.sgd(0.1).init({"w": np.ones(2)}), [{}, {}]),
    "nested": ({"a": {}, "b": [], "c": {"d": ()}}, {"a": {}, "b": [], "c": {"d": []}}),
    "mixed": (
        {"w": np.arange(3.0), "opt": (optax.EmptyState(),), "e": {}, "l": [np.int32(4), []]},
        {"w": np.arange(3.0), "opt": [{}], "e": {}, "l": [np.int32(4), []]},
    ),
}


@pytest.mark.parametrize("form", list(EMPTY_FORMS))
def test_empty_trees_round_trip_with_and_without_like(tmp_path, form):
    tree, as_plain = EMPTY_FORMS[form]
    fop.save(tmp_path / "ckpt", tree)
    assert_same_tree(fop.restore(tmp_path / "ckpt"), as_plain)
    assert_same_tree(fop.restore(tmp_path / "ckpt", tree), tree)
    assert not [n for n in (tmp_path).iterdir() if ".partial-" in n.name]


def test_like_with_an_empty_node_where_an_array_was_saved_is_refused(tmp_path):
    fop.save(tmp_path / "ckpt", {"a": np.ones(2)})
    with pytest.raises(fop.StructureError, match=r"leaf 'a'.*found"):
        fop.restore(tmp_path / "ckpt", {"a": {}})
    fop.save(tmp_path / "ckpt2", {"a": {}})
    with pytest.raises(fop.StructureError, match=r"leaf 'a'.*empty"):
        fop.restore(tmp_path / "ckpt2", {"a": np.ones(2)})


@pytest.mark.parametrize("form", ["dict", "optax_sgd", "nested", "mixed"])
def test_empty_items_round_trip_through_the_manager(tmp_path, form):
    tree, as_plain = EMPTY_FORMS[form]
    params = {"w": np.ones(3, np.float32)}
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, {"params": params, "opt_state": tree})
        mngr.save(2, {"params": params, "opt_state": tree}, extras={})
    reader = fop.CheckpointManager(tmp_path, read_only=True)
    for step in (1, 2):
        out = reader.restore(like={"params": params, "opt_state": tree}, step=step)
        assert_same_tree(out["opt_state"], tree)
        assert_same_tree(reader.restore(step=step, items="opt_state"), as_plain)
    assert reader.restore(step=2, items="extras") == {}
