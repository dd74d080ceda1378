"""A reader whose step is deleted by the writer's retention mid-read is told so
(issue 11, point 11), instead of being told the data is damaged."""

import os

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import restore as _restore
from flax_orbax_plugin._format import layout as _layout


def state(i):
    return {"params": {"w": np.full((300_000,), i, np.float32), "b": np.full(3, i, np.int32)}}


@pytest.fixture
def writer(tmp_path):
    with fop.CheckpointManager(tmp_path, keep=2, async_save=False) as mngr:
        mngr.save(1, state(1))
        mngr.save(2, state(2))
        yield mngr


def delete_after_metadata_is_read(monkeypatch, when_reading, action):
    """Runs ``action`` (the writer's real retention) right after the reader has read the
    metadata of a checkpoint under ``when_reading``, before any array data is read."""
    real = _restore.read_document
    done = []

    def read_then_act(location):
        doc = real(location)
        if not done and str(location).startswith(str(when_reading)):
            done.append(True)
            action()
        return doc

    monkeypatch.setattr(_restore, "read_document", read_then_act)
    return done


def test_reader_of_a_step_that_retention_deletes_gets_step_deleted_error(
    tmp_path, writer, monkeypatch
):
    def retention_removes_step_1():
        writer.save(3, state(3))  # keep=2: retention removes step 1
        writer.wait()
        assert writer.steps() == [2, 3]

    done = delete_after_metadata_is_read(monkeypatch, tmp_path / "1", retention_removes_step_1)
    reader = fop.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(
        fop.StepDeletedError, match=r"(/1/params|step 1 of .*) was deleted while"
    ) as info:
        reader.restore(step=1, items="params")
    assert done
    assert isinstance(info.value, fop.CheckpointNotFoundError)
    assert not isinstance(info.value, fop.CorruptCheckpointError)
    out = reader.restore(items="params")  # the newest step is there
    np.testing.assert_array_equal(out["w"], 3)


def test_reader_of_a_step_deleted_right_after_listing_gets_step_deleted_error(
    tmp_path, writer, monkeypatch
):
    real = _layout.read_manifest

    def delete_then_read(step_loc):
        if step_loc.name == "1":
            writer.save(3, state(3))  # keep=2: retention removes step 1
            writer.wait()
        return real(step_loc)

    monkeypatch.setattr(_layout, "read_manifest", delete_then_read)
    reader = fop.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(fop.StepDeletedError, match=r"step 1 of .* was deleted while"):
        reader.restore(step=1)
    assert reader.steps() == [2, 3]


def test_core_restore_of_a_checkpoint_removed_mid_read(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    fop.save(path, state(1)["params"])
    done = delete_after_metadata_is_read(
        monkeypatch, path, lambda: fop.CheckpointManager(tmp_path)._loc.child("ckpt").remove()
    )
    with pytest.raises(fop.StepDeletedError, match=r"ckpt was deleted while it was being read"):
        fop.restore(path)
    assert done and not os.path.exists(path)


def test_damaged_data_of_a_checkpoint_still_there_stays_a_corruption_error(tmp_path):
    path = tmp_path / "ckpt"
    fop.save(path, state(1)["params"], format_version=1)  # its chunk files removed
    removed = []
    for dirpath, _, files in os.walk(path / "d"):
        for f in files:
            if f != "zarr.json":
                os.remove(os.path.join(dirpath, f))
                removed.append(f)
    assert removed
    with pytest.raises(fop.CorruptCheckpointError, match=r"'w'.*damaged or missing") as info:
        fop.restore(path)
    assert not isinstance(info.value, fop.StepDeletedError)
