"""Superseding a save in flight (``supersede=``): the slow save is cancelled, not waited
for; nothing of it commits, its staging is removed, earlier steps stay whole; with two
real processes both agree on what was cancelled.

A slow save comes from the package's own fault point ``mid_write`` (``FOP_PAUSE_AT``,
``_base/env.py``): its background write sleeps there, then meets the cancellation at
its next check.
"""

import os
import time

import numpy as np
import pytest

import flax_orbax_plugin as fop

PAUSE_S = "0.6"


def tiny(step: int) -> dict:
    return {"params": {"w": np.full((64,), step, np.float32)}}


def _entries(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n != ".writer.lock")


def _save_slow_then_next(mngr, monkeypatch) -> fop.SaveHandle:
    """Step 1 committed, step 2's write held at mid_write, then step 3 saved."""
    mngr.save(1, tiny(1))
    mngr.wait()
    monkeypatch.setenv("FOP_PAUSE_AT", "mid_write")
    monkeypatch.setenv("FOP_PAUSE_S", PAUSE_S)
    mngr.save(2, tiny(2))
    slow = mngr.pending_save
    time.sleep(0.1)  # its background write is now in the pause
    monkeypatch.delenv("FOP_PAUSE_AT")
    assert slow is not None and not slow.done()
    mngr.save(3, tiny(3))
    mngr.wait()
    return slow


@pytest.mark.parametrize("supersede", [True, False])
def test_a_newer_save_supersedes_a_slow_one(tmp_path, monkeypatch, caplog, supersede):
    """supersede=True: step 2 (still writing when step 3 starts) is cancelled: never
    committed, its staging gone, step 1 untouched, step 3 committed; its handle holds the
    SaveCancelledError. Default: step 3 waits for step 2, and both commit."""
    with fop.CheckpointManager(tmp_path, supersede=supersede) as mngr:
        slow = _save_slow_then_next(mngr, monkeypatch)
        steps = mngr.steps()
        restored = mngr.restore(step=1)
    if not supersede:
        assert steps == [1, 2, 3] and slow.error is None
        return
    assert steps == [1, 3]
    assert _entries(tmp_path) == ["1", "3"]  # no 2.partial-* left behind
    assert isinstance(slow.error, fop.SaveCancelledError)
    assert "superseded by step 3" in str(slow.error)
    assert "superseded by step 3" in caplog.text  # a loud warning: a step was dropped
    np.testing.assert_array_equal(restored["params"]["w"], tiny(1)["params"]["w"])


def test_saves_that_outlast_a_step_still_commit_every_other_one(tmp_path, monkeypatch):
    """Every save slower than a step: a save that replaced a cancelled one is waited for,
    so steps still commit (before, a whole run could commit nothing until close)."""
    monkeypatch.setenv("FOP_PAUSE_AT", "mid_write")
    monkeypatch.setenv("FOP_PAUSE_S", "0.8")
    with fop.CheckpointManager(tmp_path, supersede=True) as mngr:
        for step in range(1, 8):
            mngr.save(step, tiny(step))
            time.sleep(0.05)  # each save is still in its pause when the next starts
        mngr.wait()
        steps = mngr.steps()
    assert steps == [2, 4, 6, 7], steps


def test_supersede_preemption_only_cancels_for_a_preemption_save(tmp_path, monkeypatch):
    """supersede="preemption": an ordinary newer save still waits for the slow one."""
    with fop.CheckpointManager(tmp_path, supersede="preemption", handle_sigterm=True) as mngr:
        slow = _save_slow_then_next(mngr, monkeypatch)
        assert mngr.steps() == [1, 2, 3] and slow.error is None


@pytest.mark.parametrize(
    "options, words",
    [
        ({"supersede": "always"}, "supersede"),
        ({"supersede": True, "async_save": False}, "supersede=True does nothing without async"),
        ({"supersede": "preemption"}, "does nothing without handle_sigterm=True"),
    ],
)
def test_supersede_is_checked_where_it_enters(tmp_path, options, words):
    with pytest.raises(fop.OptionError, match=words):
        fop.CheckpointManager(tmp_path, **options)


def test_cancel_returns_whether_anything_committed(tmp_path):
    handle = fop.save_async(tmp_path / "c", tiny(1))
    handle.wait()
    assert handle.cancel() is False  # committed first: stays committed
    assert fop.is_committed(tmp_path / "c")


def supersede_on_two_processes(ctx, directory):
    """Worker: process 0's write of step 2 is slow (paused), process 1's is done and
    waits in the commit; both then save step 3, superseding step 2."""
    import _mp_workers as W

    out = {}
    with fop.CheckpointManager(directory, supersede=True) as mngr:
        mngr.save(1, W.make_state(ctx, 1))
        mngr.wait()
        if ctx.process_id == 0:
            os.environ.update(FOP_PAUSE_AT="mid_write", FOP_PAUSE_S=PAUSE_S)
        mngr.save(2, W.make_state(ctx, 2))
        slow = mngr.pending_save
        time.sleep(0.2)
        os.environ.pop("FOP_PAUSE_AT", None)
        mngr.save(3, W.make_state(ctx, 3))
        mngr.wait()
        out["error"] = type(slow.error).__name__
        out["steps"] = mngr.steps()
    return out


@pytest.mark.distributed
def test_two_processes_agree_on_what_was_cancelled(tmp_path):
    """One process cancels while its write is slow, the other had already written its
    part: the cancellation is the commit's agreed outcome (SaveCancelledError on both),
    never one process committing; the directory holds steps 1 and 3 only."""
    import _mp_workers as W
    from _multiprocess import run_processes

    directory = str(tmp_path / "ck")
    run = run_processes(
        "test_supersede:supersede_on_two_processes",
        2,
        args={"directory": directory},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        heartbeat_timeout_s=10,
        done_timeout_s=5,
    )
    run.check()
    for p in run.procs:
        assert p.result == {"error": "SaveCancelledError", "steps": [1, 3]}, p.result
    assert _entries(directory) == ["1", "3"]
    host = fop.restore_params(directory)
    np.testing.assert_array_equal(host["w"], W.expected_w(4) + 3)


def test_a_preemption_save_supersedes_a_slow_one(tmp_path, monkeypatch):
    """supersede="preemption" with a real SIGTERM: the next save is the preemption save;
    it cancels step 2 (still writing), commits step 3, closes and leaves with 143."""
    import signal

    mngr = fop.CheckpointManager(tmp_path, supersede="preemption", handle_sigterm=True)
    mngr.save(1, tiny(1))
    mngr.wait()
    monkeypatch.setenv("FOP_PAUSE_AT", "mid_write")
    monkeypatch.setenv("FOP_PAUSE_S", PAUSE_S)
    mngr.save(2, tiny(2))
    slow = mngr.pending_save
    time.sleep(0.1)
    monkeypatch.delenv("FOP_PAUSE_AT")
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as left:
        mngr.save(3, tiny(3))
    assert left.value.code == 128 + signal.SIGTERM
    assert isinstance(slow.error, fop.SaveCancelledError)
    assert _entries(tmp_path) == ["1", "3"]
