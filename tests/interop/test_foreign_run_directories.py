"""A writer is never opened on another library's run (an Orbax run, Flax msgpack
``checkpoint_<n>`` files): resuming there "started afresh" (step 0, fresh weights, a
warning) and wrote new steps beside the old ones, after which ``restore_params`` read
the fresh weights. Refused, naming what is there and the conversion; nothing written."""

from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization

import flax_orbax_plugin as fop

TREE = {"params": {"w": np.arange(3, dtype=np.float32)}}


def _orbax(path):
    with ocp.CheckpointManager(path) as mngr:
        mngr.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(TREE)))
        mngr.wait_until_finished()


def _msgpack(path):
    os.makedirs(path)
    with open(os.path.join(path, "checkpoint_9"), "wb") as f:
        f.write(serialization.to_bytes(TREE))


@pytest.mark.parametrize(
    ("make", "words"), [(_orbax, "an Orbax run"), (_msgpack, "Flax msgpack checkpoints")]
)
@pytest.mark.parametrize("resume", [True, False, "required"])
def test_a_resume_on_another_librarys_run_is_refused(tmp_path, make, words, resume):
    where = tmp_path / "run"
    make(where)
    before = sorted(os.listdir(where))
    cb = fop.CheckpointCallback(where, every_steps=1, resume=resume)
    with pytest.raises(fop.CheckpointError, match=rf"holds {words}.*flax-orbax import"):
        cb.on_train_start(TREE)
    with pytest.raises(fop.CheckpointError, match=words):
        fop.CheckpointManager(where)
    assert sorted(os.listdir(where)) == before  # nothing written, no lock left


def test_what_was_imported_resumes_and_the_foreign_run_still_reads(tmp_path):
    where = tmp_path / "orbax"
    _orbax(where)
    fop.import_orbax(where, tmp_path / "ours")
    with fop.CheckpointManager(tmp_path / "ours") as mngr:
        assert mngr.steps() == [7]
    np.testing.assert_array_equal(fop.restore_params(where)["w"], TREE["params"]["w"])


@pytest.mark.parametrize(
    ("make", "words", "reader"),
    [
        (_orbax, "an Orbax run", "fop.restore and fop.restore_params"),
        (_msgpack, "Flax msgpack checkpoints", "fop.restore_msgpack"),
    ],
)
def test_a_reader_on_another_librarys_run_says_what_reads_it(tmp_path, make, words, reader):
    """A read-only manager there listed no steps (``steps() == []``, ``latest_step()``
    None) and its restore said "no committed steps": the run looked empty. Refused at
    open, naming what reads it and the conversion."""
    where = tmp_path / "run"
    make(where)
    before = sorted(os.listdir(where))
    with pytest.raises(fop.CheckpointError, match=rf"holds {words}.*{reader}.*flax-orbax import"):
        fop.CheckpointManager(where, read_only=True)
    assert sorted(os.listdir(where)) == before
