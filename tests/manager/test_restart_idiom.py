"""A job restarted with the same command (issue 25): resume=True from the first start."""

from __future__ import annotations

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
