"""Misuse of the Orbax entry points is one of the library's errors, naming what was
expected: ``step=`` on a step or item directory (which holds one step) is an
OptionError pointing at the run directory; a ``like`` naming an item a JSON-only step
lacks is a StructureError (it was a raw IndexError building a hint)."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest

import flax_orbax_plugin as fop


@pytest.fixture
def run(tmp_path):
    path = tmp_path / "run"
    mngr = ocp.CheckpointManager(path, item_names=("params",))
    for step in (2, 4):
        tree = {"w": np.full(3, step, np.float32)}
        mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
    mngr.wait_until_finished()
    mngr.close()
    return path


@pytest.mark.parametrize("sub", ["4", "4/params"])
def test_step_on_a_step_or_item_directory_is_an_option_error(run, sub):
    for read in (fop.restore_orbax, fop.restore_params):
        with pytest.raises(fop.OptionError, match=r"step=2: .*name the run directory"):
            read(run / sub, step=2)
    got = fop.restore_params(run, step=2)  # the run with step= reads it
    np.testing.assert_array_equal(got["w"], np.full(3, 2, np.float32))


def test_a_like_naming_an_item_a_json_only_step_lacks(tmp_path):
    mngr = ocp.CheckpointManager(tmp_path / "run", item_names=("meta",))
    mngr.save(0, args=ocp.args.Composite(meta=ocp.args.JsonSave({"a": 1})))
    mngr.wait_until_finished()
    mngr.close()
    like = {"params": {"w": np.zeros(3, np.float32)}}
    for path in (tmp_path / "run", tmp_path / "run" / "0"):
        with pytest.raises(fop.StructureError, match=r"item 'params': expected by like.*'meta'"):
            fop.restore(path, like=like)
        with pytest.raises(fop.StructureError, match=r"item 'params': expected by like"):
            fop.restore_orbax(path, like=like)


def test_metadata_names_no_directory_as_an_item(run, tmp_path):
    """fop.metadata on an Orbax directory says what it holds: a step that is one item
    (flax.training.checkpoints' checkpoint_<N>) or an item directory is one item, not
    an item named after its own directory."""
    flax_run = tmp_path / "flax_run"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(flax_run / "checkpoint_120", {"w": np.zeros(2, np.float32)})
    for path, said in (
        (flax_run, r"\(step 120, one pytree item\)"),
        (run / "4" / "params", r"\(one pytree item\)"),
        (run / "4", r"\(step 4, items \['params'\]\)"),
    ):
        with pytest.raises(fop.CheckpointNotFoundError, match=said):
            fop.metadata(path)
