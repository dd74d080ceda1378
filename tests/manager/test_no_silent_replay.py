"""Resuming without the data iterator a step holds warns once (issue 25), and only a
training resume does: never a read-only or serving restore (issue 32)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import flax_orbax_plugin as fop


def batch_at(index):
    return {"x": np.full(2, index, np.float32)}


def saved_run(directory):
    it = fop.StepIndexedIterator(batch_at)
    state = {"params": {"w": np.zeros(2, np.float32)}}
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        for step in (1, 2):
            next(it)
            mngr.save(step, state, data_iterator=it)
    return state


def replay_warnings(record):
    return [w for w in record if "holds a 'data_iterator' item" in str(w.message)]


def test_manager_restore_without_iterator_warns_once(tmp_path):
    state = saved_run(tmp_path / "run")
    with fop.CheckpointManager(tmp_path / "run") as mngr:  # a writer: a training resume
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            mngr.restore(like=state)
            mngr.restore()  # no arguments: a dict of every item but the position
            mngr.restore(like=state)
        (warning,) = replay_warnings(record)
        message = str(warning.message)
        assert "step 2 of" in message and "data_iterator=" in message
        assert "items=" in message and "reset=('data_iterator',)" in message
        # silenced: the iterator given, or the items named
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            it = fop.StepIndexedIterator(batch_at)
            mngr.restore(like=state, data_iterator=it)
            mngr.restore(like=state, items=["params"])
        assert not replay_warnings(record)
        assert next(it)["x"][0] == 2  # the position was restored


def test_callback_without_iterator_warns_and_reset_silences(tmp_path):
    state = saved_run(tmp_path / "run")
    cb = fop.CheckpointCallback(tmp_path / "run", resume=True)
    with pytest.warns(UserWarning, match=r"holds a 'data_iterator' item.*on_train_start"):
        cb.on_train_start(state)
    cb.close()
    for kwargs in ({"data_iterator": fop.StepIndexedIterator(batch_at)}, {}):
        cb = fop.CheckpointCallback(tmp_path / "run", resume=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            if kwargs:
                cb.on_train_start(state, **kwargs)
            else:
                cb.on_train_start(state, reset=("data_iterator",))
        cb.close()
        assert not replay_warnings(record), kwargs
        assert cb.resumed_step == 2


def test_read_only_and_serving_restores_never_warn(tmp_path):
    state = saved_run(tmp_path / "run")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with fop.CheckpointManager(tmp_path / "run", read_only=True) as mngr:
            mngr.restore(like=state)  # reading a run (evaluation, serving, inspection)
            mngr.restore()
        with fop.CheckpointManager(tmp_path / "run") as mngr:
            mngr.restore(like=state, items=("params",))
            mngr.restore(items="params")
        fop.restore_params(tmp_path / "run", like=state["params"])
        fop.restore_params(tmp_path / "run")
    assert not replay_warnings(record), [str(w.message) for w in record]


def test_callback_resetting_another_item_still_warns(tmp_path):
    """reset=("opt_state",) restores the rest of the state through named items: the
    data position is still left out, so the resume would replay the data."""
    state = {**saved_run(tmp_path / "run"), "opt_state": {"mu": np.zeros(2, np.float32)}}
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        it = fop.StepIndexedIterator(batch_at)
        mngr.save(3, state, data_iterator=it)
    cb = fop.CheckpointCallback(tmp_path / "run", resume=True)
    with pytest.warns(UserWarning, match=r"step 3 of .*holds a 'data_iterator' item"):
        cb.on_train_start(state, reset=("opt_state",))
    cb.close()
    cb = fop.CheckpointCallback(tmp_path / "run", resume=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cb.on_train_start(state, reset=("opt_state", "data_iterator"))
    cb.close()
    assert not replay_warnings(record)


def test_no_warning_when_the_step_holds_no_position(tmp_path):
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(1, {"params": {"w": np.zeros(2)}})
    with fop.CheckpointManager(tmp_path / "run", read_only=True) as mngr:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            mngr.restore()
        assert not replay_warnings(record)


def test_items_the_like_lacks_are_named_not_dropped_silently(tmp_path):
    """A saved batch_stats (or an NNX rngs) that the given state lacks was discarded
    without a word; naming the items leaves them out on purpose, quietly."""
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(1, {"params": {"w": np.zeros(3)}, "batch_stats": {"m": np.ones(3)}})
        with pytest.warns(UserWarning, match=r"holds item\(s\) \['batch_stats'\] that like"):
            mngr.restore({"params": {"w": np.zeros(3)}})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mngr.restore({"params": {"w": np.zeros(3)}}, items=["params"])
