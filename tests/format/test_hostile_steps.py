"""Hostile ``step=`` values of the readers (issue 32, the red-team pass): a bool (True
was read as step 1, silently), a str, a float or a list (a raw "'str' object cannot be
interpreted as an integer" naming no option) is a TypeError naming ``step`` and what
was found, through restore_params, CheckpointManager.restore and fop.verify; a numpy
integer still names a step."""

from __future__ import annotations

import numpy as np
import pytest

import flax_orbax_plugin as fop

TREE = {"params": {"w": np.ones(2, np.float32)}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("steps") / "run"
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        mngr.save(1, TREE)
    return directory


def _manager(run, step):
    with fop.CheckpointManager(run, read_only=True) as mngr:
        return mngr.restore(step=step)


READERS = {
    "restore_params": lambda run, step: fop.restore_params(run, step=step),
    "manager": _manager,
    "verify": lambda run, step: fop.verify(run, step=step),
}
HOSTILE = [(True, "bool True"), (False, "bool False"), ("1", "str '1'"), (1.0, "float 1.0")]
HOSTILE += [([1], r"list \[1\]")]


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("step,found", HOSTILE, ids=["true", "false", "str", "float", "list"])
def test_a_step_that_is_no_int_is_named(run, reader, step, found):
    with pytest.raises(TypeError, match=rf"step.*found {found}"):
        READERS[reader](run, step)


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_numpy_integer_still_names_a_step(run, reader):
    assert READERS[reader](run, np.int64(1))
