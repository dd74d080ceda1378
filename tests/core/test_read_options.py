"""The read entry points' keyword options checked by their declarations where they
enter (issue 32): fop.restore, fop.verify, fop.restore_params."""

from __future__ import annotations

import re

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format.steps import MAX_STEP

NAN = float("nan")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("read_options")
    fop.save(root / "c", {"w": np.arange(4.0)})
    with fop.CheckpointManager(root / "run") as mngr:
        mngr.save(1, {"params": {"w": np.arange(4.0)}})
    return root


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"memory_limit_bytes": "x"}, "memory_limit_bytes must be a positive int"),  # was raw
        ({"memory_limit_bytes": -1}, "found int -1"),  # was taken
        ({"memory_limit_bytes": 10**30}, "<= 9223372036854775807"),
        ({"memory_limit_bytes": NAN}, "found float nan"),
        ({"share_replicated_reads": "x"}, "share_replicated_reads must be True, False or None"),
    ],
)
def test_restore_refuses_a_hostile_option(saved, kwargs, words):
    with pytest.raises(fop.OptionError) as info:
        fop.restore(saved / "c", **kwargs)
    assert str(info.value).startswith(next(iter(kwargs))) and words in str(info.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"step": "1"}, f"step must be an int step in [0, {MAX_STEP}] or None, found str '1'"),
        ({"step": -1}, f"step must be an int step in [0, {MAX_STEP}] or None, found int -1"),
        ({"all_steps": "no"}, "all_steps must be True or False, found str 'no'"),  # was: True
        ({"step": 1, "all_steps": True}, "step=1 and all_steps=True conflict"),
    ],
)
def test_verify_refuses_a_hostile_option(saved, kwargs, words):
    with pytest.raises(fop.OptionError, match="^" + re.escape(words)):
        fop.verify(saved / "run", **kwargs)


@pytest.mark.parametrize("step, words", [("x", "found str 'x'"), (1.5, "found float 1.5")])
def test_restore_params_refuses_a_hostile_step(saved, step, words):
    with pytest.raises(fop.OptionError, match=r"^step must be an int step in \[0, ") as info:
        fop.restore_params(saved / "run", step=step)
    assert words in str(info.value)


def test_good_read_options_are_taken(saved):
    np.testing.assert_array_equal(
        fop.restore(saved / "c", memory_limit_bytes=1 << 20)["w"], np.arange(4.0)
    )
    assert all(r.ok for r in fop.verify(saved / "run", step=1))
    assert all(r.ok for r in fop.verify(saved / "run", all_steps=True))
    np.testing.assert_array_equal(
        fop.restore_params(saved / "run", step=np.int64(1))["w"], np.arange(4.0)
    )


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"cast": "maybe"}, fop.OptionError),
        ({"partial": "yes"}, fop.OptionTypeError),
        ({"missing": "skip"}, fop.OptionError),
    ],
)
def test_restore_options_are_option_errors_naming_them(saved, kwargs, error):
    """The kinds every other option raises (still ValueError / TypeError subclasses)."""
    with pytest.raises(error, match=next(iter(kwargs))):
        fop.restore(saved / "run", **kwargs)
