"""Commits on FUSE mounts of buckets (issue 54 item 2): detected from the mount table,
committed by the step manifest written last (no directory rename); a crash at any
point leaves no step that looks complete.

The FUSE mount is a shim in a child process: the mount-type lookup says
``fuse.gcsfuse`` and ``os.rename`` of a directory copies it file by file, then
deletes the source (as GCS Fuse does: not atomic). The child is SIGKILLed at several
points of its second save; the parent then lists the directory: every listed step
must restore whole, with the values saved.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from _proc import child_env

import flax_orbax_plugin as fop
from flax_orbax_plugin._storage import location as mounts

CHILD = r"""
import os, shutil, signal, sys
import numpy as np
import flax_orbax_plugin as fop
from flax_orbax_plugin._storage import location as mounts

directory, detect, log = sys.argv[1], sys.argv[2] == "detect", sys.argv[3]
if detect:
    mounts.mount_type = lambda path: "fuse.gcsfuse"

real_rename = os.rename
renames = 0

def fuse_rename(src, dst, *args, **kwargs):
    # a directory of a bucket mount: copied file by file, then the source deleted
    global renames
    if args or kwargs or not os.path.isdir(src):
        return real_rename(src, dst, *args, **kwargs)
    renames += 1
    with open(log, "a") as f:
        f.write(f"{src} -> {dst}\n")
    os.mkdir(dst)
    copied = 0
    for root, dirs, files in os.walk(src):
        dirs.sort()
        rel = os.path.relpath(root, src)
        for d in dirs:
            os.mkdir(os.path.join(dst, rel, d))
        for name in sorted(files):
            shutil.copyfile(os.path.join(root, name), os.path.join(dst, rel, name))
            copied += 1
            if os.environ.get("SHIM_KILL_MID_COPY") == str(renames) and copied == 2:
                os.kill(os.getpid(), signal.SIGKILL)
    shutil.rmtree(src)

os.rename = fuse_rename

def state(v):
    return {"params": {"w": np.full(64, v, np.float32), "b": np.full(3, v, np.int32)}}

with fop.CheckpointManager(directory, keep=3) as m:
    for step in (1, 2):
        if step not in m.steps():  # a second run resumes after the first one's steps
            m.save(step, state(step), extras={"loss": float(step)})
            m.wait()
print("done")
"""


def _run(tmp_path, detect: bool, **env):
    directory, log = str(tmp_path / "run"), str(tmp_path / "renames.log")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, directory, "detect" if detect else "off", log],
        env=child_env(JAX_PLATFORMS="cpu", **env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    renamed = open(log).read().splitlines() if os.path.exists(log) else []
    return proc, directory, renamed


def _complete_steps_restore_whole(directory):
    """Every step a reader lists restores whole, with the values that step saved."""
    mngr = fop.CheckpointManager(directory, read_only=True)
    steps = mngr.steps()
    for step in steps:
        params = mngr.restore(step=step, items=("params",))["params"]
        np.testing.assert_array_equal(params["w"], np.full(64, step, np.float32))
        np.testing.assert_array_equal(params["b"], np.full(3, step, np.int32))
        assert mngr.restore(step=step, items=("extras",))["extras"] == {"loss": float(step)}
    return steps


@pytest.mark.parametrize(
    "kill_at", ["after_snapshot:2", "mid_write:2", "after_sync:2", "after_marker:2"]
)
def test_a_crash_on_a_fuse_mount_leaves_no_step_that_looks_complete(tmp_path, kill_at):
    proc, directory, renamed = _run(tmp_path, True, FOP_KILL_AT=kill_at)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert renamed == []  # no directory was renamed: the manifest, written last, commits
    steps = _complete_steps_restore_whole(directory)
    assert steps == ([1, 2] if kill_at.startswith("after_marker") else [1])
    # the next save there cleans up and commits
    proc, directory, _ = _run(tmp_path, True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _complete_steps_restore_whole(directory) == [1, 2]


def test_a_fuse_mount_commits_without_renaming_and_restores(tmp_path):
    proc, directory, renamed = _run(tmp_path, True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert renamed == []
    assert _complete_steps_restore_whole(directory) == [1, 2]
    assert sorted(os.listdir(directory)) == [".writer.lock", "1", "2"]


def test_the_shim_bites_where_nothing_detects_the_mount(tmp_path):
    """Without the detection (a directory rename commits), the same FUSE rename killed
    midway leaves step 2's name holding its manifest but not its data: a step that
    looks complete. What the detection above prevents."""
    proc, directory, renamed = _run(tmp_path, False, SHIM_KILL_MID_COPY="2")
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert len(renamed) == 2
    mngr = fop.CheckpointManager(directory, read_only=True)
    assert mngr.steps() == [1, 2]  # listed as committed ...
    with pytest.raises(fop.CheckpointError):  # ... but not whole
        mngr.restore(step=2, items=("params",))


# -- detection --------------------------------------------------------------------------

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
40 27 0:50 / /mnt/bucket rw,nosuid,nodev,relatime - fuse.gcsfuse my-bucket rw,user_id=0
41 40 0:51 / /mnt/bucket/local\\040disk rw - ext4 /dev/sdb rw
42 27 0:52 / /mnt/s3 rw - fuse s3fs rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/mnt/bucket/run/1", "fuse.gcsfuse"),
        ("/mnt/bucket", "fuse.gcsfuse"),
        ("/mnt/bucketful/run", "ext4"),  # a prefix of the name only: not inside it
        ("/mnt/bucket/local disk/run", "ext4"),  # a mount inside the FUSE mount
        ("/mnt/s3/x", "fuse"),
        ("/home/me", "ext4"),
    ],
)
def test_the_mount_type_of_a_path(path, kind):
    assert mounts.mount_type_in(path, MOUNTINFO) == kind


def test_fuse_types():
    assert all(mounts.is_fuse(t) for t in ("fuse", "fuse.gcsfuse", "fuseblk", "fuse.s3fs"))
    assert not any(mounts.is_fuse(t) for t in ("ext4", "tmpfs", "overlay", "nfs", None))


def test_this_machines_temporary_directory_renames(tmp_path):
    assert not mounts.is_fuse(mounts.mount_type(str(tmp_path)))
    assert fop.CheckpointManager  # the default stays a rename here
    assert not mounts.commits_by_file(str(tmp_path / "not" / "yet"))


def test_fop_commit_chooses_explicitly(tmp_path, monkeypatch):
    monkeypatch.setattr(mounts, "mount_type", lambda path: "fuse.gcsfuse")
    assert mounts.commits_by_file(str(tmp_path))
    monkeypatch.setenv("FOP_COMMIT", "rename")
    assert not mounts.commits_by_file(str(tmp_path))
    monkeypatch.setattr(mounts, "mount_type", lambda path: "ext4")
    monkeypatch.setenv("FOP_COMMIT", "file")
    assert mounts.commits_by_file(str(tmp_path))
    monkeypatch.setenv("FOP_COMMIT", "atomic")
    with pytest.raises(fop.OptionError, match="FOP_COMMIT.*'atomic'"):
        mounts.commits_by_file(str(tmp_path))
