"""A step number is checked the same way wherever it enters: an int (numpy or jax
integer scalars too) in [0, MAX_STEP], the largest a step directory's name holds.
A float is never truncated (4.7 saved as step 4), a bool never read as step 1, a
step past MAX_STEP never committed where no listing would see it again."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format.steps import MAX_STEP

TREE = {"params": {"w": np.arange(6, dtype=np.float32)}}
BAD = [
    pytest.param(2**70, fop.OptionError, id="past-max"),
    pytest.param(MAX_STEP + 1, fop.OptionError, id="max+1"),
    pytest.param(-1, fop.OptionError, id="negative"),
    pytest.param(4.7, fop.OptionTypeError, id="float"),
    pytest.param("5", fop.OptionTypeError, id="str"),
    pytest.param(True, fop.OptionTypeError, id="bool"),
    pytest.param(jnp.float32(6.0), fop.OptionTypeError, id="jax-float"),
]


@pytest.fixture
def run(tmp_path):
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as m:
        m.save(1, TREE)
    return tmp_path / "run"


def _entry_points(run, tmp_path):
    """Each entry point that takes a step, as a function of the step."""
    like = {"w": np.zeros(6, np.float32)}

    def callback_step(step):
        with fop.CheckpointCallback(tmp_path / "cb", every_steps=1) as cb:
            cb.on_step_end(step, TREE)

    def callback_end(step):
        with fop.CheckpointCallback(tmp_path / "cb2", every_steps=1) as cb:
            cb.on_train_end(TREE, step=step)

    def manager(method):
        def call(step):
            with fop.CheckpointManager(run) as m:
                method(m, step)

        return call

    return {
        "manager.save": manager(lambda m, s: m.save(s, TREE)),
        "manager.restore": manager(lambda m, s: m.restore(step=s)),
        "manager.delete": manager(lambda m, s: m.delete(s)),
        "manager.should_save": manager(lambda m, s: m.should_save(s)),
        "callback.on_step_end": callback_step,
        "callback.on_train_end": callback_end,
        "fop.verify": lambda s: fop.verify(run, step=s),
        "fop.restore_params": lambda s: fop.restore_params(run, like=like, step=s),
    }


@pytest.mark.parametrize(("step", "error"), BAD)
def test_every_entry_point_refuses_a_bad_step_naming_it(run, tmp_path, step, error):
    for name, call in _entry_points(run, tmp_path).items():
        with pytest.raises(error, match="step") as caught:
            call(step)
        assert str(MAX_STEP) in str(caught.value) or "int" in str(caught.value), name
    # Nothing was written by any of them: the run still holds step 1 alone.
    assert fop.CheckpointManager(run, read_only=True).steps() == [1]


def test_integer_scalars_of_numpy_and_jax_are_steps(tmp_path):
    with fop.CheckpointCallback(tmp_path / "cb", every_steps=1) as cb:
        assert cb.on_step_end(jnp.int32(3), TREE)
        assert cb.on_step_end(np.int64(4), TREE)
    with fop.CheckpointManager(tmp_path / "cb", async_save=False) as m:
        assert m.save(MAX_STEP, TREE)
        assert m.steps() == [3, 4, MAX_STEP]
