"""fop.restore / fop.metadata on a run directory or an Orbax checkpoint say what it
is and what to call (issue 25), not "its save was interrupted"."""

from __future__ import annotations

import numpy as np
import pytest

import flax_orbax_plugin as fop


@pytest.fixture
def run(tmp_path):
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        for step in (1, 2):
            mngr.save(step, {"params": {"w": np.full(3, step, np.float32)}})
    return tmp_path / "run"


@pytest.mark.parametrize("call", [fop.restore, fop.metadata])
def test_run_directory_names_what_to_call(run, call):
    with pytest.raises(fop.CheckpointNotFoundError) as info:
        call(run)
    message = str(info.value)
    assert "is a run directory of CheckpointManager (steps 1, 2)" in message
    assert "fop.CheckpointManager(" in message and "fop.restore_params(" in message
    assert f"{run}/2/params" in message
    assert "interrupted" not in message
    # the item it names is what the call accepts
    assert call(run / "2" / "params") is not None


def test_run_directory_without_a_committed_step(tmp_path):
    with fop.CheckpointManager(tmp_path / "run"):
        with pytest.raises(fop.CheckpointNotFoundError, match="no committed step yet"):
            fop.restore(tmp_path / "run")


def test_an_interrupted_save_is_still_called_one(tmp_path):
    (tmp_path / "ckpt").mkdir()  # a save that never committed: no records, no steps
    with pytest.raises(fop.NotCommittedError, match="interrupted"):
        fop.restore(tmp_path / "ckpt")


def test_metadata_on_an_orbax_checkpoint_says_what_it_is(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path / "orbax"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"w": np.arange(4, dtype=np.float32)})
        ckptr.wait_until_finished()
    with pytest.raises(fop.CheckpointNotFoundError) as info:
        fop.metadata(path)
    message = str(info.value)
    assert "is an Orbax checkpoint" in message and "fop.import_orbax" in message
    assert "interrupted" not in message
    np.testing.assert_array_equal(fop.restore(path)["w"], np.arange(4, dtype=np.float32))
