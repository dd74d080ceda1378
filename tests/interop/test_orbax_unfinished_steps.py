"""A save Orbax never finished, named directly, is refused by every entry point, as a
run's listing already passes it over: a killed async save leaves
``<step>.orbax-checkpoint-tmp/`` (its JSON items finished, a pytree item still
``params.orbax-checkpoint-tmp/``) whose ``_CHECKPOINT_METADATA`` has a null
``commit_timestamp_nsecs``. Reading it as done would give a partial step (only its
JSON items) and an import would commit it as a whole one."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import flax_orbax_plugin as fop

_UNFINISHED = r"unfinished Orbax save"


def _run(path) -> None:
    mngr = ocp.CheckpointManager(path, item_names=("params", "meta"))
    for step in (1, 2):
        args = {
            "params": ocp.args.StandardSave({"w": np.full(3, step, np.float32)}),
            "meta": ocp.args.JsonSave({"s": step}),
        }
        mngr.save(step, args=ocp.args.Composite(**args))
    mngr.wait_until_finished()
    mngr.close()


def _null_commit_time(step_dir) -> None:
    record_path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
    with open(record_path) as f:
        record = json.load(f)
    record["commit_timestamp_nsecs"] = None  # what a save killed before finalizing leaves
    with open(record_path, "w") as f:
        json.dump(record, f)


@pytest.fixture
def killed(tmp_path):
    """A run whose step 3 is what a killed async save leaves (as orbax 0.12.8 does)."""
    run = tmp_path / "run"
    _run(run)
    tmp_step = run / "3.orbax-checkpoint-tmp"
    shutil.copytree(run / "2", tmp_step)
    os.rename(tmp_step / "params", tmp_step / "params.orbax-checkpoint-tmp")
    os.remove(tmp_step / "commit_success.txt")
    _null_commit_time(tmp_step)
    return run, tmp_step


def test_restore_refuses_an_unfinished_step(killed):
    _, tmp_step = killed
    with pytest.raises(fop.CheckpointNotFoundError, match=_UNFINISHED):
        fop.restore(tmp_step)
    with pytest.raises(fop.CheckpointNotFoundError, match=_UNFINISHED):
        fop.restore_orbax(tmp_step)
    with pytest.raises(fop.CheckpointNotFoundError, match=_UNFINISHED):
        fop.restore(tmp_step, like={"params": {"w": np.zeros(3, np.float32)}}, partial=True)
    with pytest.raises(fop.CheckpointNotFoundError, match=_UNFINISHED):
        fop.restore_params(tmp_step)


def test_an_item_of_an_unfinished_step_is_refused(killed):
    _, tmp_step = killed
    with pytest.raises(fop.CheckpointNotFoundError, match=_UNFINISHED):
        fop.restore(tmp_step / "params.orbax-checkpoint-tmp")
    with pytest.raises(fop.CheckpointNotFoundError, match=_UNFINISHED):
        fop.restore_params(tmp_step / "params.orbax-checkpoint-tmp")


def test_import_of_an_unfinished_step_writes_nothing(killed, tmp_path):
    run, tmp_step = killed
    out = tmp_path / "out"
    with pytest.raises(fop.CheckpointNotFoundError, match=_UNFINISHED):
        fop.import_orbax(tmp_step, out, step=3)
    assert not os.path.exists(out / "3")
    assert fop.import_orbax(run, tmp_path / "whole") == [1, 2]  # the run passes it over


def test_a_step_whose_record_has_no_commit_time_is_refused(killed):
    run, _ = killed
    _null_commit_time(run / "2")  # named like a finalized step, but never finalized
    with pytest.raises(fop.CheckpointNotFoundError, match=r"commit_timestamp_nsecs: null"):
        fop.restore(run / "2")
    got = fop.restore(run / "1")  # a finished step still reads
    np.testing.assert_array_equal(got["params"]["w"], np.full(3, 1, np.float32))
    assert got["meta"] == {"s": 1}


def test_metadata_says_the_step_is_unfinished(killed):
    _, tmp_step = killed
    with pytest.raises(fop.CheckpointNotFoundError, match=_UNFINISHED):
        fop.metadata(tmp_step)
