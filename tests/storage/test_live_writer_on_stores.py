"""Object stores have no writer lock, so a manager there holds a lease (its run record,
``_storage/lease.py``): a second open (or ``gc``) on a path another process writes to
is refused, and that save's step is left alone. Before, the second writer removed the
step's staged files as a dead save's, and the save then committed without them (a
committed step whose restore failed: 'chunk ... missing or short'); then, with only
this host's live-writer rule, it opened, saved its own steps and its retention removed
the first writer's (a real second process on the moto server)."""

from __future__ import annotations

import subprocess
import sys

import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop

pytest_plugins = ["_servers"]

WRITER = """
import sys
import numpy as np
import flax_orbax_plugin as fop

with fop.CheckpointManager(sys.argv[1], async_save=False) as mngr:
    mngr.save(2, {"params": {"w": np.full((64, 64), 2.0, np.float32)}})
print("SAVED", flush=True)
"""


def test_a_second_open_leaves_a_live_writers_step_alone(s3_location):
    url = s3_location.url
    with fop.CheckpointManager(url) as mngr:
        mngr.save(1, {"params": {"w": np.full((64, 64), 1.0, np.float32)}})
    env = _proc.child_env(FOP_PAUSE_AT="before_commit", FOP_PAUSE_S="3", **s3_location.env)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, url], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        err = b""
        while b"FOP_PAUSED" not in err:  # step 2 written, its writer paused before its commit
            line = proc.stderr.readline()
            assert line, (proc.wait(timeout=60), err)
            err += line
        with pytest.raises(fop.DirectoryLockedError, match=r"is held by run .* lease expires"):
            fop.CheckpointManager(url)  # a second writer: refused, nothing removed
        with fop.CheckpointManager(url, read_only=True) as reader:  # reading is fine
            assert reader.steps() == [1]
        out, rest = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and b"SAVED" in out, (err + rest).decode()[-3000:]
    with fop.CheckpointManager(url, read_only=True) as mngr:
        assert mngr.steps() == [1, 2]
        np.testing.assert_array_equal(mngr.restore(step=2)["params"]["w"], np.full((64, 64), 2.0))
    assert all(r.ok for r in fop.verify(url, all_steps=True))


def test_a_store_that_refuses_the_markers_removal_still_commits(s3_location, monkeypatch):
    """A bucket policy allowing PUT but not DELETE: the commit marker is written, so the
    save is committed; before, it was reported 'not committed' (and the manager's step,
    listed and whole, was called failed)."""
    monkeypatch.setenv("FOP_FAIL_AT", "unclaim:1:EACCES")
    url = s3_location.join("core").url
    fop.save(url, {"w": np.ones(8, np.float32)})
    assert fop.is_committed(url)
    np.testing.assert_array_equal(fop.restore(url)["w"], np.ones(8, np.float32))
    run = s3_location.join("run").url  # every removal of a pending marker refused
    with fop.CheckpointManager(run) as mngr:
        for step in (1, 2):
            mngr.save(step, {"params": {"w": np.full(8, float(step), np.float32)}})
            mngr.wait()
        assert mngr.steps() == [1, 2]
    assert all(r.ok for r in fop.verify(run, all_steps=True))


def test_a_tier_is_refused_a_persistent_path_a_plain_writer_holds(s3_location, tmp_path):
    """The tier's persistent path and a plain writer's directory share one lease."""
    with fop.CheckpointManager(s3_location.url) as plain:
        plain.save(1, {"params": {"w": np.ones(8, np.float32)}})
        plain.wait()
        with pytest.raises(fop.DirectoryLockedError, match=r"held by run .*: this process"):
            fop.CheckpointManager(tmp_path / "local", persistent=fop.Tier(s3_location.url))
    with fop.CheckpointManager(tmp_path / "local", persistent=fop.Tier(s3_location.url)) as tiered:
        assert tiered.latest_step(include_persistent=True) == 1  # released: the run goes on
