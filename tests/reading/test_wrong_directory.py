"""fop.restore / fop.metadata on a run directory or an Orbax checkpoint say what it
is and what to call (issue 25), not "its save was interrupted"; an empty directory, a
directory above a run and a step given to restore_params are named for what they are at
every reading entry point, the CLI's too (issue 32); only a real interrupted save is
called interrupted."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys

import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

pytest_plugins = ["_servers"]


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


def test_an_interrupted_save_is_still_called_one(tmp_path, interrupted):
    """A save killed before its commit (a real ``.partial-`` staging beside the path on
    local disk, the pending marker and metadata under the prefix on S3)."""
    path = interrupted(tmp_path)
    for call in (fop.restore, fop.metadata):
        with pytest.raises(fop.NotCommittedError, match="its save was interrupted"):
            call(path)


@pytest.fixture(params=["local", "s3"])
def interrupted(request):
    """``make(tmp_path) -> path`` of a core save killed after writing its metadata."""

    def make(tmp_path):
        if request.param == "local":
            path = str(tmp_path / "ckpt")
        else:
            path = request.getfixturevalue("s3_location").url
        env = _proc.child_env(JAX_PLATFORMS="cpu", FOP_KILL_AT="after_metadata")
        code = "import sys, numpy as np, flax_orbax_plugin as fop\n"
        code += "fop.save(sys.argv[1], {'w': np.arange(8, dtype=np.float32)})\n"
        proc = subprocess.run(
            [sys.executable, "-c", code, path], env=env, capture_output=True, timeout=120
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        if request.param == "local":
            assert any(".partial-" in n for n in os.listdir(tmp_path))
        return path

    return make


def _entry_points(path, tmp_path):
    """(name, message) of every reading entry point called on ``path``: each must fail."""
    out = []
    for call in (fop.restore, fop.metadata, fop.restore_params):
        with pytest.raises(fop.CheckpointError) as info:
            call(path)
        out.append((call.__name__, str(info.value)))
    for argv in (
        ["inspect", path],
        ["verify", path],
        ["list", path],
        ["export", path, str(tmp_path / "out.safetensors")],
    ):
        stream = io.StringIO()
        with contextlib.redirect_stderr(stream), contextlib.redirect_stdout(stream):
            rc = cli.main([str(a) for a in argv])
        out.append((argv[0], stream.getvalue()))
        if argv[0] != "list":
            assert rc == cli.EXIT_ERROR, (argv, stream.getvalue())
    return out


def test_an_empty_directory_is_called_empty_everywhere(tmp_path):
    (tmp_path / "empty").mkdir()
    for where, message in _entry_points(tmp_path / "empty", tmp_path):
        assert "an empty directory" in message, (where, message)
        assert "interrupted" not in message and "still running" not in message, where
    assert not (tmp_path / "out.safetensors").exists()


@pytest.fixture(params=["local", "s3"])
def parent(request, tmp_path):
    """A directory whose children are a run directory and a core checkpoint."""
    if request.param == "local":
        top = str(tmp_path / "experiments")
    else:
        top = request.getfixturevalue("s3_location").url
    with fop.CheckpointManager(f"{top}/run", async_save=False) as mngr:
        mngr.save(7, {"params": {"w": np.full(3, 7, np.float32)}})
    fop.save(f"{top}/core", {"w": np.zeros(2, np.float32)})
    return top


def test_a_directory_above_a_run_names_the_run(parent, tmp_path):
    for where, message in _entry_points(parent, tmp_path):
        assert "one level down" in message, (where, message)
        assert f"{parent}/run (a run directory of CheckpointManager, latest step 7)" in message
        assert f"{parent}/core (a checkpoint of one pytree)" in message
        assert "interrupted" not in message and "no committed steps in" not in message, where
    # and what it names is what the calls accept
    np.testing.assert_array_equal(fop.restore_params(f"{parent}/run")["w"], np.full(3, 7))
    np.testing.assert_array_equal(fop.restore(f"{parent}/core")["w"], np.zeros(2))


def test_restore_params_on_a_step_or_an_item_names_the_run_and_the_step(run):
    with pytest.raises(fop.CheckpointNotFoundError) as info:
        fop.restore_params(run / "2")
    assert f"step 2 of the run directory {run}" in str(info.value)
    assert f"fop.restore_params({str(run)!r}, step=2)" in str(info.value)
    with pytest.raises(fop.CheckpointNotFoundError, match="an item of step 1 of the run"):
        fop.restore_params(run / "1" / "params")


def test_a_run_whose_only_step_was_interrupted_says_so(tmp_path):
    (tmp_path / "run" / "4.partial-abc123").mkdir(parents=True)
    with pytest.raises(fop.CheckpointNotFoundError, match="4.partial-abc123 were interrupted"):
        fop.restore_params(tmp_path / "run")
    rc = cli.main(["inspect", str(tmp_path / "run")])
    assert rc == cli.EXIT_ERROR


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


def test_a_folder_inside_a_checkpoint_names_the_checkpoint(run, tmp_path):
    inner = next(p for p in (run / "2" / "params").iterdir() if p.is_dir())
    for where, message in _entry_points(inner, tmp_path):
        assert f"a folder inside the item {run}/2/params" in message, (where, message)
        assert "interrupted" not in message, where


def test_a_run_without_params_points_at_an_item_it_holds(tmp_path):
    """The hint named '<run>/1/params' in a run whose only item is 'weights'."""
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"weights": {"w": np.ones(3, np.float32)}})
    with pytest.raises(fop.CheckpointNotFoundError) as caught:
        fop.restore(tmp_path / "run")
    named = f"{tmp_path / 'run'}/1/weights"
    assert repr(named) in str(caught.value), caught.value
    np.testing.assert_array_equal(fop.restore(named)["w"], np.ones(3, np.float32))
