"""A job restarted with the same command (issue 25): resume=True from the first start."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import flax_orbax_plugin as fop


def job(directory, *, resume, until):
    """The same command every time: resume per `resume`, train to `until`, save."""
    cb = fop.CheckpointCallback(directory, every_steps=2, resume=resume)
    state = cb.on_train_start({"w": np.zeros(2, np.float32), "step": 0})
    first = int(state["step"]) + 1
    for step in range(first, until + 1):
        state = {"w": state["w"] + 1, "step": step}
        cb.on_step_end(step, state)
    cb.close()  # preempted: no on_train_end, the last policy save is what survives
    return first, state


def test_same_command_starts_fresh_then_resumes(tmp_path):
    first, state = job(tmp_path / "run", resume=True, until=5)  # first start: nothing there
    assert first == 1
    first, state = job(tmp_path / "run", resume=True, until=8)  # the restart
    assert first == 5  # step 4 was the last policy save before the "preemption"
    np.testing.assert_array_equal(state["w"], np.full(2, 8, np.float32))


def test_resume_false_refusal_names_the_idiom(tmp_path):
    job(tmp_path / "run", resume=True, until=2)
    with pytest.raises(fop.CheckpointError, match="refusing to mix two runs") as info:
        job(tmp_path / "run", resume=False, until=2)
    assert "restarted with the same command" in str(info.value)
    assert "resume=True from its first start" in str(info.value)


def new_run_warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "nothing to resume" in r.getMessage()
    ]


def test_resume_true_on_a_mistyped_path_warns_naming_it(tmp_path, caplog):
    """A typo in the path of a restarted job starts a new run: a WARNING says so (an
    INFO line was all there was), naming the directory; a real resume says nothing."""
    caplog.set_level(logging.INFO, logger="flax_orbax_plugin")
    job(tmp_path / "run", resume=True, until=2)
    caplog.clear()
    mistyped = tmp_path / "rnu"
    first, _ = job(mistyped, resume=True, until=2)
    assert first == 1 and mistyped.is_dir()
    (message,) = new_run_warnings(caplog)
    assert f"resume=True but {mistyped} did not exist and was created" in message
    assert "resume='required'" in message
    caplog.clear()
    (tmp_path / "empty").mkdir()
    job(tmp_path / "empty", resume=True, until=1)
    (message,) = new_run_warnings(caplog)
    assert f"{tmp_path / 'empty'} holds no committed step" in message
    caplog.clear()
    first, _ = job(tmp_path / "run", resume=True, until=3)  # the real restart
    assert first == 3 and not new_run_warnings(caplog)
    with pytest.raises(fop.CheckpointNotFoundError, match="resume='required'"):
        job(tmp_path / "other", resume="required", until=1)


def test_the_warning_names_the_persistent_tier_too(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="flax_orbax_plugin")
    cb = fop.CheckpointCallback(
        tmp_path / "local", resume=True, manager_options={"persistent": str(tmp_path / "bucket")}
    )
    try:
        cb.on_train_start({"w": np.zeros(2, np.float32)})
    finally:
        cb.close()
    (message,) = new_run_warnings(caplog)
    assert f"{tmp_path / 'local'} (nor its persistent tier" in message
    assert "bucket" in message
