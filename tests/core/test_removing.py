"""What a removal leaves: files a user put inside a step or a checkpoint of ours.

Real managers, ``fop.save``, the ``gc`` command and a real SIGKILL mid-removal, on local
disk, the moto S3 server and ``memory://``. Every removal (retention, ``delete``,
``gc``, the next writer finishing a killed one) removes only what the library wrote;
replacing a checkpoint that holds someone else's files is refused.
"""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from _proc import child_env

import flax_orbax_plugin as fop
from flax_orbax_plugin.cli.main import main as cli_main

pytest_plugins = ["_servers"]


def state(step: int) -> dict:
    return {"params": {"w": np.full((4,), step, np.float32)}, "opt_state": {"m": np.zeros(2)}}


# A user's files in step 1: beside the items, inside a pytree item, inside the JSON
# item, and an empty directory inside an item.
USER_FILES = ("NOTES.txt", "params/mine.txt", "extras/plot.json")
USER_DIR = "opt_state/mine"


def add_user_files(step_dir: str) -> None:
    for name in USER_FILES:
        with open(os.path.join(step_dir, name), "w") as f:
            f.write("the user's")
    os.mkdir(os.path.join(step_dir, USER_DIR))


def files_under(path: str) -> set[str]:
    out = set()
    for root, dirs, files in os.walk(path):
        rel = os.path.relpath(root, path)
        out.update(os.path.normpath(os.path.join(rel, n)) for n in files)
        empty = [d for d in dirs if not os.listdir(os.path.join(root, d))]
        out.update(os.path.normpath(os.path.join(rel, d)) for d in empty)
    return out


def test_retention_leaves_a_users_files_in_a_step_and_says_so(tmp_path, caplog):
    d = str(tmp_path / "run")
    with fop.CheckpointManager(d, keep=1) as mngr:
        mngr.save(1, state(1), extras={"loss": 1.0})
        mngr.wait()
        add_user_files(os.path.join(d, "1"))
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            mngr.save(2, state(2), extras={"loss": 0.5})
            mngr.wait()
        assert mngr.steps() == [2]
    assert files_under(os.path.join(d, "1")) == {*USER_FILES, USER_DIR}
    said = caplog.text
    assert "left alone 4 entries it did not write" in said and "NOTES.txt" in said
    # A later writer's open leaves them too, and lists the folder as not ours.
    with fop.CheckpointManager(d, keep=1) as mngr:
        assert mngr.steps() == [2]
        np.testing.assert_array_equal(mngr.restore()["params"]["w"], state(2)["params"]["w"])
    assert files_under(os.path.join(d, "1")) == {*USER_FILES, USER_DIR}


def test_delete_and_gc_leave_a_users_files(tmp_path, capsys):
    d = str(tmp_path / "run")
    with fop.CheckpointManager(d) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, state(step), extras={"loss": 1.0})
        mngr.wait()
        add_user_files(os.path.join(d, "1"))
        add_user_files(os.path.join(d, "2"))
        mngr.delete(1)
        assert mngr.steps() == [2, 3]
    assert files_under(os.path.join(d, "1")) == {*USER_FILES, USER_DIR}
    assert cli_main(["gc", d, "--keep", "1"]) == 0
    assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == ["1", "2", "3"]
    assert files_under(os.path.join(d, "2")) == {*USER_FILES, USER_DIR}
    with fop.CheckpointManager(d, read_only=True) as reader:
        assert reader.steps() == [3]


def test_a_custom_checkpointables_directory_is_all_its_own(tmp_path):
    """The library cannot tell a custom item's files from a user's: the item's
    directory goes whole (its checkpointable wrote it), a user's file beside it stays."""

    class Blob:
        kind = "blob"

        def save(self, directory, value, request=None):
            directory.write_bytes("blob.bin", bytes(value))
            return self

        def wait(self):
            return None

        def restore(self, directory, like, request=None):
            return directory.read_bytes("blob.bin")

    d = str(tmp_path / "run")
    with fop.CheckpointManager(d, keep=1, checkpointables={"blob": Blob()}) as mngr:
        mngr.save(1, {"blob": b"one"})
        mngr.wait()
        with open(os.path.join(d, "1", "NOTES.txt"), "w") as f:
            f.write("x")
        mngr.save(2, {"blob": b"two"})
        mngr.wait()
    assert files_under(os.path.join(d, "1")) == {"NOTES.txt"}


def test_replacing_a_checkpoint_that_holds_a_users_file_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    fop.save(path, {"w": np.ones(3)})
    with open(os.path.join(path, "README"), "w") as f:
        f.write("x")
    with pytest.raises(fop.ForeignEntryError, match=r"did not write \(README\)"):
        fop.save(path, {"w": np.zeros(3)}, force=True)
    np.testing.assert_array_equal(fop.restore(path)["w"], np.ones(3))
    d = str(tmp_path / "run")
    with fop.CheckpointManager(d) as mngr:
        mngr.save(1, state(1), extras={"loss": 1.0})
        mngr.wait()
        add_user_files(os.path.join(d, "1"))
        with pytest.raises(fop.ForeignEntryError, match="NOTES.txt"):
            mngr.save(1, state(5), overwrite=True)
            mngr.wait()
    assert files_under(os.path.join(d, "1")) >= {*USER_FILES, USER_DIR}


KILLED = """
import os, sys
import numpy as np
import flax_orbax_plugin as fop
d = sys.argv[1]
with fop.CheckpointManager(d, keep=1) as m:
    m.save(1, {"params": {"w": np.ones(4, np.float32)}}, extras={"loss": 1.0})
    m.wait()
    open(os.path.join(d, "1", "NOTES.txt"), "w").write("the user's")
    m.save(2, {"params": {"w": np.full(4, 2, np.float32)}})
    m.wait()
"""


def test_a_removal_killed_midway_leaves_the_users_file_when_finished(tmp_path):
    d = str(tmp_path / "run")
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, d],
        env=child_env(JAX_PLATFORMS="cpu", FOP_KILL_AT="mid_retention"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    with open(os.path.join(d, "1", "_PENDING.json")) as f:
        assert "NOTES.txt" in f.read()  # the marker records what the removal leaves
    with fop.CheckpointManager(d, keep=1) as mngr:
        assert mngr.steps() == [2]
    assert files_under(os.path.join(d, "1")) == {"NOTES.txt"}


@pytest.mark.parametrize("store", ["s3", "memory"])
def test_object_store_retention_leaves_a_users_object(store, request):
    if store == "memory":
        where = "memory://removing-test/run"
    else:
        where = request.getfixturevalue("s3_location").url
    run = fop.Location.from_path(where)  # the store the manager writes (memory: its context)
    with fop.CheckpointManager(where, keep=1) as mngr:
        mngr.save(1, state(1))
        mngr.wait()
        run.child("1").write_bytes("NOTES.txt", b"the user's")
        run.child("1").write_bytes("params/mine.txt", b"the user's")
        mngr.save(2, state(2))
        mngr.wait()
        assert mngr.steps() == [2]
    left = sorted(k for k in run.keys() if k.startswith("1/"))
    assert left == ["1/NOTES.txt", "1/params/mine.txt"]
    with fop.CheckpointManager(where, read_only=True) as reader:
        assert reader.steps() == [2]
