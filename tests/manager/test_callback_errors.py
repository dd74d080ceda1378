"""A hook's or a writer's error raised by a later save never costs the callback its
bookkeeping: the step that save saved is noted, on_train_end closes cleanly; inputs that
reach the commit's bookkeeping are checked where they are given."""

from __future__ import annotations

import numpy as np
import pytest

import flax_orbax_plugin as fop


def _state(step: int) -> dict:
    return {"params": {"w": np.full(3, step, np.float32)}}


def test_a_hook_error_raised_by_a_later_save_leaves_that_step_noted(tmp_path):
    """Before: on_train_end saved step 4 again ('steps must increase') and left the
    directory locked."""

    def hook(event):
        if isinstance(event, fop.SaveCommitted) and event.step == 2:
            raise RuntimeError("hook bug")

    cb = fop.CheckpointCallback(tmp_path, every_steps=2, on_event=hook)
    cb.on_train_start(_state(0))
    raised = 0
    for step in range(1, 5):
        try:
            cb.on_step_end(step, _state(step))
        except fop.EventHookError:
            raised += 1
    assert raised == 1
    cb.on_train_end(_state(4))
    with fop.CheckpointManager(tmp_path) as mngr:  # closed: no live writer left
        assert mngr.steps() == [2, 4]


def test_a_writers_error_is_a_hook_error_after_the_step_is_saved(tmp_path):
    """Before: the writer's raw OSError, step 2 left out of the callback's books, and
    on_train_end's 'steps must increase'."""

    class Writer:
        def write_scalars(self, step, scalars):
            raise OSError("tensorboard is down")

    cb = fop.CheckpointCallback(tmp_path, every_steps=1, async_save=False, writer=Writer())
    cb.on_train_start(_state(0))
    with pytest.raises(fop.EventHookError, match=r"write_scalars raised OSError"):
        cb.on_step_end(1, _state(1))
    with pytest.raises(fop.EventHookError):
        cb.on_step_end(2, _state(2))
    cb.on_train_end(_state(2))
    with fop.CheckpointManager(tmp_path) as mngr:
        assert mngr.steps() == [1, 2]


@pytest.mark.parametrize("level", [None, "INFO", 5.5, True, -1])
def test_a_bad_commit_log_level_is_refused_when_set(tmp_path, level):
    """Before: accepted, then every wait() raised logging's TypeError and retention
    never ran."""
    with fop.CheckpointManager(tmp_path, keep=1) as mngr:
        with pytest.raises(fop.OptionError, match=r"^commit_log_level must be an int"):
            mngr.commit_log_level = level
        mngr.commit_log_level = np.int64(20)
        for step in (1, 2):
            mngr.save(step, _state(step))
            mngr.wait()
        assert mngr.steps() == [2]


def test_a_metric_beyond_any_float_is_no_metric(tmp_path):
    """Before: OverflowError from the ranking, the step not saved."""
    with fop.CheckpointManager(tmp_path, keep=1, keep_best=1, best_metric="loss") as mngr:
        with pytest.warns(UserWarning, match="loss"):
            mngr.save(1, _state(1), extras={"loss": 10**400})
            mngr.wait()
        assert mngr.steps() == [1]


def test_an_iterator_that_cannot_take_the_saved_position_says_where_it_came_from(tmp_path):
    """Before: a bare KeyError from the user's set_state."""

    class Other:
        def __next__(self):
            return 0

        def get_state(self):
            return {"k": 0}

        def set_state(self, state):
            self.k = state["k"]

    it = fop.StepIndexedIterator(lambda i: i)
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, _state(1), data_iterator=it)
    with fop.CheckpointManager(tmp_path) as mngr, pytest.raises(KeyError) as caught:
        mngr.restore(like=_state(0), data_iterator=Other())
    notes = " ".join(getattr(caught.value, "__notes__", []))
    assert "data_iterator.set_state() of a Other" in notes and "another kind of iterator" in notes
