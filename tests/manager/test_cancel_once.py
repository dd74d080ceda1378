"""A save cancelled through its handle (``pending_save.cancel()``) is reported once, as
a SaveCancelledError (by the cancel's return, the handle's ``error`` and its own
``wait``), never again by the manager (its next save, ``wait``, ``close``) nor by a
callback, and never costs a later step. Every wait that takes a timeout checks it and
never cancels: one past ``threading.TIMEOUT_MAX`` waits, a bad one is an OptionError,
one that runs out a TimeoutError, and the save goes on and commits.

A slow save comes from the package's fault point ``mid_write`` (``FOP_PAUSE_AT``)."""

import math
import os
import threading
import time

import numpy as np
import pytest

import flax_orbax_plugin as fop

PAUSE_S = "0.6"
BAD_TIMEOUTS = [-1, -0.5, math.nan, math.inf, -math.inf, "1", True, [1]]


def tiny(step: int) -> dict:
    return {"params": {"w": np.full((64,), step, np.float32)}}


def entries(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n != ".writer.lock")


def slow_save(mngr, step, monkeypatch) -> fop.SaveHandle:
    monkeypatch.setenv("FOP_PAUSE_AT", "mid_write")
    monkeypatch.setenv("FOP_PAUSE_S", PAUSE_S)
    mngr.save(step, tiny(step))
    handle = mngr.pending_save
    time.sleep(0.1)  # its background write is now in the pause
    monkeypatch.delenv("FOP_PAUSE_AT")
    assert handle is not None and not handle.done()
    return handle


@pytest.mark.parametrize("reason", [None, "the user changed their mind"])
def test_a_cancel_is_reported_once_and_costs_no_later_step(tmp_path, monkeypatch, reason):
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, tiny(1))
        mngr.wait()
        slow = slow_save(mngr, 2, monkeypatch)
        assert (slow.cancel() if reason is None else slow.cancel(reason=reason)) is True
        assert isinstance(slow.error, fop.SaveCancelledError), repr(slow.error)
        assert (reason or "cancel()") in str(slow.error)
        with pytest.raises(fop.SaveCancelledError):  # the handle itself has no result
            slow.wait()
        assert mngr.save(3, tiny(3)) is True  # never raises the cancel: step 3 is saved
        mngr.wait()
        mngr.save(4, tiny(4))
    assert entries(tmp_path) == ["1", "3", "4"]  # nothing of step 2 left
    got = fop.CheckpointManager(tmp_path, read_only=True).restore(step=3)
    np.testing.assert_array_equal(got["params"]["w"], tiny(3)["params"]["w"])


def test_a_cancel_then_wait_and_close_raise_nothing(tmp_path, monkeypatch):
    mngr = fop.CheckpointManager(tmp_path)
    mngr.save(1, tiny(1))
    slow_save(mngr, 2, monkeypatch).cancel()
    mngr.wait()
    mngr.close()
    assert entries(tmp_path) == ["1"]


def test_a_callbacks_cancelled_save_costs_no_later_step(tmp_path, monkeypatch):
    cb = fop.CheckpointCallback(tmp_path, every_steps=1)
    state = cb.on_train_start(tiny(0))
    cb.on_step_end(1, state)
    cb.wait()
    monkeypatch.setenv("FOP_PAUSE_AT", "mid_write")
    monkeypatch.setenv("FOP_PAUSE_S", PAUSE_S)
    cb.on_step_end(2, tiny(2))
    time.sleep(0.1)
    monkeypatch.delenv("FOP_PAUSE_AT")
    assert cb.manager.pending_save.cancel() is True
    assert cb.on_step_end(3, tiny(3)) is True
    cb.on_train_end(tiny(4), step=4)
    assert entries(tmp_path) == ["1", "3", "4"]


def test_a_save_handles_wait_checks_its_timeout_and_never_cancels(tmp_path, monkeypatch):
    monkeypatch.setenv("FOP_PAUSE_AT", "mid_write")
    monkeypatch.setenv("FOP_PAUSE_S", PAUSE_S)
    handle = fop.save_async(tmp_path / "c", tiny(1))
    for bad in BAD_TIMEOUTS:
        with pytest.raises(fop.OptionError, match="timeout"):
            handle.wait(timeout=bad)
    with pytest.raises(TimeoutError, match="still running"):
        handle.wait(timeout=0.01)
    assert not handle.done()  # neither a bad timeout nor one that ran out cancelled it
    result = handle.wait(timeout=1e10)  # past threading.TIMEOUT_MAX: waits, no OverflowError
    assert 1e10 > threading.TIMEOUT_MAX
    assert result.path == str(tmp_path / "c") and fop.is_committed(tmp_path / "c")


def test_a_managers_pending_save_waits_past_timeout_max(tmp_path, monkeypatch):
    with fop.CheckpointManager(tmp_path) as mngr:
        slow = slow_save(mngr, 1, monkeypatch)
        with pytest.raises(fop.OptionError, match="timeout"):
            slow.wait(timeout=-1)
        assert slow.wait(timeout=1e10).step == 1
        mngr.save(2, tiny(2))  # the next save neither raises nor loses its step
    assert entries(tmp_path) == ["1", "2"]


def test_the_persistent_tiers_waits_check_their_timeout(tmp_path):
    remote = tmp_path / "remote"
    with fop.CheckpointManager(tmp_path / "local", persistent=remote) as mngr:
        mngr.save(1, tiny(1))
        mngr.wait()
        for bad in BAD_TIMEOUTS:
            with pytest.raises(fop.OptionError, match="timeout"):
                mngr.persistent.wait(bad)
            with pytest.raises(fop.OptionError, match="timeout"):
                mngr.persistent.close(bad)
        assert mngr.persistent.wait(1e10) is True
    assert fop.CheckpointManager(remote, read_only=True).steps() == [1]
