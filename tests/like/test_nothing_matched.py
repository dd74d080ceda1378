"""A restore that matched nothing raises (issue 32): partial=True with missing="keep"
(or a transform that drops or misnames every leaf) used to hand back like untouched,
and the callback logged "resumed step 40" with freshly initialised weights. Every
entry point now raises NothingMatchedError naming the options and paths of both
sides; missing="keep_all" is the explicit opt-in, with a WARNING naming the options."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import flax_orbax_plugin as fop

SAVED = {"params": {"Dense_0": {"kernel": np.ones((2, 2), np.float32)}}, "opt_state": {"mu": 1.5}}


def renamed_model():
    """A model whose layer names match nothing saved (its values freshly initialised)."""
    return {
        "params": {"hidden": {"kernel": np.zeros((2, 2), np.float32)}},
        "opt_state": {"mu": 0.0},
    }


@pytest.fixture
def run(tmp_path):
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(40, SAVED)
    return tmp_path / "run"


def through_restore(run, **opts):
    return fop.restore(run / "40" / "params", renamed_model()["params"], **opts)


def through_manager(run, **opts):
    with fop.CheckpointManager(run, read_only=True) as mngr:
        return mngr.restore(like=renamed_model(), **opts)["params"]


def through_callback(run, **opts):
    cb = fop.CheckpointCallback(run, resume=True)
    try:
        return cb.on_train_start(renamed_model(), **opts)["params"]
    finally:
        cb.close()


def through_restore_params(run, **opts):
    return fop.restore_params(run, renamed_model()["params"], **opts)


ENTRY_POINTS = [through_restore, through_manager, through_callback, through_restore_params]
OPTIONS = [
    {"partial": True, "missing": "keep"},
    {"partial": True, "missing": "keep", "transform": {r"^Dense_0/": "Dense_9/"}},
    {"missing": "keep", "transform": lambda p: None},  # every saved leaf dropped
]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("opts", OPTIONS, ids=["keep", "misnamed", "dropped"])
def test_nothing_matched_raises_naming_options_and_paths(run, entry, opts, caplog):
    caplog.set_level(logging.INFO, logger="flax_orbax_plugin")
    with pytest.raises(fop.NothingMatchedError) as info:
        entry(run, **opts)
    message = str(info.value)
    assert "matched no saved leaf" in message
    assert f"partial={opts.get('partial', False)}, missing='keep'" in message
    assert "'Dense_0/kernel'" in message  # a saved path
    assert "'hidden/kernel'" in message  # a path of like
    assert "missing='keep_all'" in message  # the explicit way to accept it
    if "transform" in opts:
        assert "transform=" in message and "after transform:" in message
    assert isinstance(info.value, fop.StructureError)
    assert not [r for r in caplog.records if "resumed step" in r.getMessage()]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_keep_all_accepts_it_with_a_warning_naming_the_options(run, entry, caplog):
    caplog.set_level(logging.INFO, logger="flax_orbax_plugin")
    out = entry(run, partial=True, missing="keep_all")
    np.testing.assert_array_equal(out["hidden"]["kernel"], np.zeros((2, 2)))  # like's own
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "matched no saved leaf (partial=True, missing='keep_all'" in r.getMessage() for r in warned
    ), [r.getMessage() for r in warned]


def test_an_item_that_matched_nothing_is_named_though_another_matched(run):
    """opt_state matches; params matches nothing: the restore raises naming params and
    the way to start that item fresh on purpose."""
    like = {"params": renamed_model()["params"], "opt_state": {"mu": 0.0}}
    with fop.CheckpointManager(run, read_only=True) as mngr:
        with pytest.raises(fop.NothingMatchedError, match=r"item 'params' of step 40.*reset="):
            mngr.restore(like=like, partial=True, missing="keep")
        restored = mngr.restore(like=like, items=["opt_state"])  # the way out it names
    assert restored["opt_state"]["mu"] == 1.5


def test_no_item_of_like_in_the_step(run):
    like = {"model": renamed_model()["params"], "optimizer": {"mu": 0.0}}
    with fop.CheckpointManager(run, read_only=True) as mngr:
        with pytest.raises(fop.NothingMatchedError, match=r"matched no saved item") as info:
            mngr.restore(like=like, missing="keep")
        assert "'opt_state', 'params'" in str(info.value) and "'model'" in str(info.value)
        assert mngr.restore(like=like, missing="keep_all")["optimizer"] == {"mu": 0.0}


def test_like_none_with_a_transform_that_drops_everything(run):
    with pytest.raises(fop.NothingMatchedError, match="would return nothing"):
        fop.restore(run / "40" / "params", None, transform=lambda p: None)


def test_a_match_is_no_error(run):
    """A real changed model (one leaf kept, one new) and an empty checkpoint pass."""
    like = {"Dense_0": {"kernel": np.zeros((2, 2), np.float32)}, "new": np.zeros(3)}
    out = fop.restore_params(run, like, missing="keep")
    np.testing.assert_array_equal(out["Dense_0"]["kernel"], np.ones((2, 2)))
    fop.save(run.parent / "empty", {})
    assert fop.restore(run.parent / "empty", {"a": np.zeros(1)}, missing="keep")["a"] == 0
