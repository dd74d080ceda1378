"""The writer lock writes only a file of its own: never through a hard link (issue 32)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._storage.lock import LOCK_FILE, DirectoryLock


@pytest.fixture
def linked(tmp_path):
    """A run directory whose lock file is a hard link of a file outside it."""
    outside = tmp_path / "notes.txt"
    outside.write_bytes(b"do not touch")
    run = tmp_path / "run"
    run.mkdir()
    os.link(outside, run / LOCK_FILE)
    return run, outside


def test_a_hard_linked_lock_file_is_refused_and_left_unchanged(linked):
    run, outside = linked
    with pytest.raises(fop.ForeignEntryError, match=r"\.writer\.lock.*2 names \(a hard link"):
        DirectoryLock(str(run)).acquire()
    with pytest.raises(fop.ForeignEntryError, match=r"\.writer\.lock.*hard link"):
        fop.CheckpointManager(run)
    assert outside.read_bytes() == b"do not touch"
    assert os.stat(outside).st_nlink == 2  # nothing removed either


def test_a_hard_linked_lock_on_the_persistent_path_is_refused(linked, tmp_path):
    persistent, outside = linked
    with pytest.raises(fop.ForeignEntryError, match=r"\.writer\.lock.*hard link"):
        fop.CheckpointManager(tmp_path / "local", persistent=str(persistent))
    assert outside.read_bytes() == b"do not touch"


def test_an_own_lock_file_is_taken_again(tmp_path):
    lock = DirectoryLock(str(tmp_path))
    lock.acquire()  # created exclusively
    lock.release()
    again = DirectoryLock(str(tmp_path))
    again.acquire()  # left by the earlier writer: one name, a regular file
    assert again.held and (tmp_path / LOCK_FILE).read_bytes().startswith(b"pid ")
    again.release()


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_writer_whose_directory_was_removed_locks_it_again(tmp_path, caplog, how):
    """The directory removed (or its lock file replaced) under an open writer: its next
    save takes the lock again, with a warning, instead of writing into a directory
    without a lock for a second writer to take; a second writer that opened it in
    between keeps it, and the first one's save is refused."""
    run = tmp_path / "run"
    m = fop.CheckpointManager(run, async_save=False)
    m.save(1, {"params": {"w": np.ones(2)}})
    if how == "removed":
        shutil.rmtree(run)
    else:
        (run / LOCK_FILE).unlink()
        (run / LOCK_FILE).write_text("")
    m.save(2, {"params": {"w": np.ones(2)}})
    assert "was removed or replaced" in caplog.text
    assert m.steps() == ([2] if how == "removed" else [1, 2])
    with pytest.raises(fop.DirectoryLockedError):
        fop.CheckpointManager(run)  # the lock is held again
    shutil.rmtree(run)
    with fop.CheckpointManager(run, async_save=False) as second:
        second.save(3, {"params": {"w": np.ones(2)}})
        for step in (4, 5):  # refused every time while the second holds the lock
            with pytest.raises(fop.DirectoryLockedError):
                m.save(step, {"params": {"w": np.ones(2)}})
        assert second.steps() == [3]
    m.save(6, {"params": {"w": np.ones(2)}})  # the second closed: taken again
    m.close()
    assert fop.CheckpointManager(run, read_only=True).steps() == [3, 6]
