"""A failing import or export removes what it created, and nothing else (issue 32).

Before: a failing import left its output directory holding only the writer's lock
file, and a failing export the output directory it had created. (Interrupted ones,
by a real SIGINT: tests/end_to_end/test_interrupts.py.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import CorruptCheckpointError
from flax_orbax_plugin._interop import importing
from flax_orbax_plugin._interop.safetensors import to_safetensors
from flax_orbax_plugin.cli.main import main as cli_main


@pytest.fixture
def broken_source(tmp_path):
    source = tmp_path / "flax_ckpt_3"  # named like a Flax msgpack checkpoint, but is not one
    source.write_bytes(b"\xc1 not msgpack " * 10)
    return source


def test_a_failing_import_removes_the_output_directories_it_created(tmp_path, broken_source):
    with pytest.raises(CorruptCheckpointError, match="not a Flax msgpack checkpoint"):
        importing.import_checkpoint(broken_source, tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()
    assert cli_main(["import", str(broken_source), str(tmp_path / "cli" / "run")]) != 0
    assert not (tmp_path / "cli").exists()


def test_a_failing_import_into_an_existing_directory_leaves_it_as_it_was(tmp_path, broken_source):
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, {"params": {"w": np.arange(4.0)}}, ignore_policy=True)
    (run / "notes.txt").write_text("mine")
    before = sorted(os.listdir(run))
    with pytest.raises(CorruptCheckpointError, match="not a Flax msgpack checkpoint"):
        importing.import_checkpoint(broken_source, run)
    assert sorted(os.listdir(run)) == before
    assert (run / "notes.txt").read_text() == "mine"
    with fop.CheckpointManager(run, read_only=True) as mngr:
        assert mngr.steps() == [1]


class _FailsOnWrite:
    """A leaf that can be planned, and fails to be read once the export is writing (a
    temporary file of its is in the output directory)."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def __array__(self, dtype=None, copy=None):
        if self.out_dir.exists() and any(".tmp-" in n for n in os.listdir(self.out_dir)):
            raise OSError("the leaf could not be read")
        return np.zeros(1000, np.float32)


def test_a_failing_export_removes_the_directories_it_created(tmp_path):
    out = tmp_path / "new" / "hf" / "model.safetensors"
    tree = {"a": np.ones(1000, np.float32), "b": _FailsOnWrite(out.parent)}
    with pytest.raises(OSError, match="could not be read"):
        to_safetensors(tree, out, max_shard_size=3000)
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="could not be read"):
        tree = {"a": np.ones(1000, np.float32), "b": _FailsOnWrite(tmp_path / "kept")}
        to_safetensors(tree, tmp_path / "kept" / "model.safetensors")
    assert os.listdir(tmp_path / "kept") == ["notes.txt"]
