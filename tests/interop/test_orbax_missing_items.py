"""An Orbax step whose record names an item that is gone (deleted by hand, or a save
cut short) is never read as a whole step: restore_params does not serve another item
as the params, a restore of the step names the missing item, and an import refuses
it. The items that are there still read when asked for alone."""

from __future__ import annotations

import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import flax_orbax_plugin as fop


def _run(path) -> None:
    mngr = ocp.CheckpointManager(path, item_names=("params", "opt_state"))
    for step in (1, 2):
        params = {"w": np.full(3, step, np.float32)}
        args = {"params": params, "opt_state": {"m": np.zeros(3, np.float32)}}
        mngr.save(
            step, args=ocp.args.Composite(**{k: ocp.args.StandardSave(v) for k, v in args.items()})
        )
    mngr.wait_until_finished()
    mngr.close()


@pytest.fixture
def run_without_params(tmp_path):
    run = tmp_path / "run"
    _run(run)
    shutil.rmtree(run / "2" / "params")
    return run


def test_restore_params_never_serves_another_item(run_without_params):
    with pytest.raises(fop.CorruptCheckpointError, match=r"item 'params' .*directory is missing"):
        fop.restore_params(run_without_params)
    older = fop.restore_params(run_without_params, step=1)  # the older step is whole
    np.testing.assert_array_equal(older["w"], np.full(3, 1, np.float32))


def test_a_restore_of_the_step_names_the_missing_item(run_without_params):
    with pytest.raises(fop.CorruptCheckpointError, match=r"item 'params' .*directory is missing"):
        fop.restore(run_without_params)
    like = {"opt_state": {"m": np.zeros(3, np.float32)}}
    with pytest.raises(fop.StructureError, match=r"item 'params'.*partial=True"):
        fop.restore(run_without_params, like=like)
    got = fop.restore(run_without_params, like=like, partial=True)  # asked for alone: read
    np.testing.assert_array_equal(got["opt_state"]["m"], np.zeros(3, np.float32))


def test_an_import_refuses_the_step(run_without_params, tmp_path):
    with pytest.raises(fop.CorruptCheckpointError, match=r"item 'params' .*directory is missing"):
        fop.import_orbax(run_without_params, tmp_path / "out")
    with fop.CheckpointManager(tmp_path / "out", read_only=True) as mngr:
        assert mngr.steps() == [1]  # the whole step before it only


def test_dry_run_on_an_orbax_run_is_refused_not_ignored(tmp_path):
    _run(tmp_path / "run")
    with pytest.raises(fop.CheckpointError, match=r"dry_run= apply to this library's"):
        fop.restore_params(tmp_path / "run", dry_run=True)
