"""A Ctrl-C held over a save's blocking phase cancels its background phase before it
starts: the KeyboardInterrupt raised at the phase's end never races the background's
commit, however fast that is. A real SIGINT (os.kill of this process) arrives while
the tree is snapshotted; the background phase is then let run to its end before the
training thread goes on (what a loaded machine may do): nothing may be committed.

Every signal here is sent inside the save's own deferral, so it never reaches pytest."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import interrupts
from flax_orbax_plugin._core import handle as _handle
from flax_orbax_plugin._core import save as _save

TREE = {"w": np.arange(64.0), "b": np.ones(3, np.float32)}


@pytest.fixture
def ctrl_c_in_snapshot_then_background_first(monkeypatch):
    """A SIGINT during the snapshot; each background phase, once started, finishes
    before the training thread continues."""
    real_snapshot, real_start = _save.snapshot, _handle.SaveHandle.start

    def snapshot(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):  # bytecodes: where a Python-level handler runs
            pass
        assert signal.getsignal(signal.SIGINT).received  # held by the save's deferral
        return real_snapshot(*args, **kwargs)

    def start(self, **options):
        real_start(self, **options)
        assert self._thread.ident is not None  # started (never refused)
        self._finished.wait(60)  # the background's whole run, before the caller goes on
        return self

    monkeypatch.setattr(_save, "snapshot", snapshot)
    monkeypatch.setattr(_handle.SaveHandle, "start", start)


def test_save_async_interrupted_in_its_blocking_phase_commits_nothing(
    tmp_path, ctrl_c_in_snapshot_then_background_first
):
    with pytest.raises(KeyboardInterrupt):
        fop.save_async(tmp_path / "ckpt", TREE)
    assert os.listdir(tmp_path) == []  # no checkpoint, no staging
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_manager_save_interrupted_in_its_blocking_phase_commits_no_step(
    tmp_path, monkeypatch, ctrl_c_in_snapshot_then_background_first
):
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        with pytest.raises(KeyboardInterrupt):
            mngr.save(1, {"params": TREE}, ignore_policy=True)
        monkeypatch.undo()  # the next save runs as any other
        assert mngr.all_steps() == []
        mngr.save(2, {"params": TREE}, ignore_policy=True)
        mngr.wait()
        assert mngr.all_steps() == [2]
    assert not (tmp_path / "run" / "1").exists()


def test_a_deferral_yields_what_it_holds():
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred_sigint() as held:
            assert held.received == []
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):
                pass
            assert held.received == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
