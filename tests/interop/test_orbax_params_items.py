"""Which params ``restore_params`` serves from an Orbax run whose items hold params more
than once (an EMA copy beside the training state): the training state's, as the import
splits them, so the raw run and its import serve the same weights; two items that hold
params alike are refused naming both, never one picked by their order."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest

import flax_orbax_plugin as fop


def _params(value: float) -> dict:
    return {"Dense_0": {"kernel": np.full((2, 2), value, np.float32)}}


def _orbax_run(path, **items) -> None:
    mngr = ocp.CheckpointManager(path, item_names=tuple(items))
    args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
    mngr.save(1, args=ocp.args.Composite(**args))
    mngr.wait_until_finished()
    mngr.close()


def test_the_training_states_params_are_served_before_and_after_import(tmp_path):
    run = tmp_path / "run"
    _orbax_run(run, ema_state={"params": _params(111.0)}, state={"params": _params(1.0), "step": 1})
    served = fop.restore_params(run)["Dense_0"]["kernel"]
    fop.import_orbax(run, tmp_path / "imported")
    imported = fop.restore_params(tmp_path / "imported")["Dense_0"]["kernel"]
    np.testing.assert_array_equal(served, _params(1.0)["Dense_0"]["kernel"])
    np.testing.assert_array_equal(imported, served)


def test_two_items_holding_params_alike_are_refused_naming_both(tmp_path):
    run = tmp_path / "run"
    _orbax_run(run, a={"params": _params(1.0)}, b={"params": _params(2.0)})
    with pytest.raises(fop.CheckpointError, match=r"params in several items \(a, b\)"):
        fop.restore_params(run)


def test_a_flax_training_checkpoints_run_written_by_orbax_reads_as_its_tree(tmp_path):
    """flax.training.checkpoints (Orbax underneath) writes each step as one item
    itself (checkpoint_<N>/_METADATA): restore of the run gives the tree, as
    restore_checkpoint does, not {'checkpoint_<N>': tree}."""
    import flax
    from flax.training import checkpoints

    flax.config.update("flax_use_orbax_checkpointing", True)
    for step in (1, 2):
        tree = {"params": {"k": np.full(3, step, np.float32)}, "step": step}
        checkpoints.save_checkpoint(str(tmp_path / "run"), tree, step=step, keep=5)
    like = {"params": {"k": np.zeros(3, np.float32)}, "step": 0}
    for got in (fop.restore(tmp_path / "run"), fop.restore(tmp_path / "run", like=like)):
        assert set(got) == {"params", "step"} and int(got["step"]) == 2
        np.testing.assert_array_equal(got["params"]["k"], np.full(3, 2, np.float32))
    got = fop.restore(tmp_path / "run" / "checkpoint_1")
    np.testing.assert_array_equal(got["params"]["k"], np.full(3, 1, np.float32))


def test_an_orbax_nnx_run_serves_its_params_with_partial(tmp_path):
    """Flax's Orbax recipe (nnx.split, StandardSave of the whole state): params alone
    into nnx.state(model, nnx.Param) said 'pass partial=True', and partial=True said
    partial= applies to this library's checkpoints only. It serves the params now."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(2, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, rngs=rngs)

    saved = Model(nnx.Rngs(0))
    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(1, args=ocp.args.StandardSave(nnx.split(saved)[1]))
        mngr.wait_until_finished()
    like = nnx.state(Model(nnx.Rngs(1)), nnx.Param)
    with pytest.raises(fop.StructureError, match="pass partial=True"):
        fop.restore_params(tmp_path / "orbax", like=like)
    got = fop.restore_params(tmp_path / "orbax", like=like, partial=True)
    np.testing.assert_array_equal(got["a"]["kernel"][...], saved.a.kernel[...])
    np.testing.assert_array_equal(got["bn"]["scale"][...], saved.bn.scale[...])
