"""Hostile ``reset=`` (CheckpointCallback.on_train_start) and ``items=``
(CheckpointManager.restore) values (issue 32, the red-team pass): each is checked where
it enters (``_state.resume.check_reset`` / ``check_items``) and a value that is not a
collection of item names is a TypeError naming the option and what was found (they
raised "'int' object is not iterable" / "argument of type 'NoneType' is not iterable");
``reset=None`` means nothing is reset."""

from __future__ import annotations

import numpy as np
import pytest

import flax_orbax_plugin as fop

TREE = {"params": {"w": np.ones(2, np.float32)}, "opt": {"m": np.zeros(2, np.float32)}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("items") / "run"
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        mngr.save(1, TREE)
    return directory


def fresh():
    return {"params": {"w": np.full(2, 7, np.float32)}, "opt": {"m": np.full(2, 7, np.float32)}}


def on_train_start(run, **kwargs):
    cb = fop.CheckpointCallback(run, resume=True)
    try:
        return cb.on_train_start(fresh(), **kwargs)
    finally:
        cb.close()


RESETS = [
    (3, r"reset must be a tuple of item names \(e.g. \('opt_state',\)\), found int 3"),
    (True, r"reset must be a tuple of item names .*found bool True"),
    ([b"opt"], r"reset: every entry is an item name \(a str\), found bytes b'opt'"),
    (b"opt", r"reset must be a tuple of item names .*found bytes b'opt'"),
    (("opt", 1), r"reset: every entry is an item name \(a str\), found int 1"),
]


@pytest.mark.parametrize(
    "reset,message", RESETS, ids=["int", "bool", "bytes-entry", "bytes", "int-entry"]
)
def test_a_reset_that_names_no_items_is_a_type_error(run, reset, message):
    with pytest.raises(TypeError, match=message):
        on_train_start(run, reset=reset)


def test_reset_none_resets_nothing(run):
    out = on_train_start(run, reset=None)
    np.testing.assert_array_equal(out["opt"]["m"], np.zeros(2))
    out = on_train_start(run, reset=["opt"])
    np.testing.assert_array_equal(out["opt"]["m"], np.full(2, 7))


ITEMS = [
    (3, r"items must be a tuple of item names .*found int 3"),
    ([3], r"items: every entry is an item name \(a str\), found int 3"),
    (b"params", r"items must be a tuple of item names .*found bytes b'params'"),
    (0, r"items must be a tuple of item names .*found int 0"),
]


@pytest.mark.parametrize("items,message", ITEMS, ids=["int", "int-entry", "bytes", "zero"])
def test_items_that_name_no_items_is_a_type_error(run, items, message):
    with fop.CheckpointManager(run, read_only=True) as mngr:
        with pytest.raises(TypeError, match=message):
            mngr.restore(items=items)
