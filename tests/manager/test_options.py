"""Options checked at construction by their public names (issue 25)."""

from __future__ import annotations

import pytest

import flax_orbax_plugin as fop

BOTH = [fop.CheckpointManager, fop.CheckpointCallback]


@pytest.mark.parametrize("cls", BOTH)
@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"keep": "3"}, TypeError, "keep"),
        ({"keep": 0}, ValueError, "keep"),
        ({"keep": True}, TypeError, "keep"),
        ({"every_steps": 2.5}, TypeError, "every_steps"),
        ({"every_seconds": "60"}, TypeError, "every_seconds"),
        ({"every_seconds": -1}, ValueError, "every_seconds"),
        ({"async_save": "no"}, TypeError, "async_save"),
    ],
)
def test_bad_value_named_at_construction(tmp_path, cls, kwargs, error, name):
    with pytest.raises(error, match=rf"^{name} must be") as info:
        cls(tmp_path / "run", **kwargs)
    assert "keep_last" not in str(info.value)
    assert not (tmp_path / "run").exists()  # refused before anything was made


@pytest.mark.parametrize("cls", BOTH)
@pytest.mark.parametrize(
    "old, new",
    [
        ("max_to_keep", "keep="),
        ("save_interval_steps", "every_steps="),
        ("every_secs", "every_seconds="),
        ("save_interval_secs", "every_seconds="),
        ("enable_async_checkpointing", "async_save="),
        ("keeep", "keep="),  # a close spelling
    ],
)
def test_known_old_names_get_did_you_mean(tmp_path, cls, old, new):
    with pytest.raises(
        TypeError, match=rf"unexpected keyword argument '{old}': did you mean {new}\?"
    ):
        cls(tmp_path / "run", **{old: 3})


def test_manager_only_names_point_into_manager_options(tmp_path):
    with pytest.raises(TypeError, match=r"did you mean manager_options=\{'keep_every': \.\.\.\}"):
        fop.CheckpointCallback(tmp_path / "run", keep_period=10)
    with pytest.raises(TypeError, match=r"did you mean manager_options=\{'persistent': \.\.\.\}"):
        fop.CheckpointCallback(tmp_path / "run", persistent="gs://b/r")
    with pytest.raises(TypeError, match=r"manager_options.*'max_to_keep': did you mean keep="):
        fop.CheckpointCallback(tmp_path / "run", manager_options={"max_to_keep": 2})


def test_unknown_name_without_a_match_lists_the_options(tmp_path):
    with pytest.raises(TypeError, match=r"'colour'\ \(its options: .*every_seconds") as info:
        fop.CheckpointManager(tmp_path / "run", colour="red")
    assert "did you mean" not in str(info.value)


def test_valid_options_still_work(tmp_path):
    with fop.CheckpointManager(
        tmp_path / "run", keep=2, every_steps=2, steps=iter([3]), keep_every=4
    ) as mngr:
        assert mngr.should_save(3) and mngr.should_save(4) and not mngr.should_save(5)


@pytest.mark.parametrize(
    "value, error", [(0, ValueError), ("5", TypeError), (2.0, TypeError), (True, TypeError)]
)
def test_persistent_every_is_checked_by_its_name(tmp_path, value, error):
    with pytest.raises(error, match=r"^persistent_every must be a positive int"):
        fop.CheckpointManager(
            tmp_path / "run", persistent=str(tmp_path / "p"), persistent_every=value
        )
    with pytest.raises(ValueError, match=r"^persistent_every=5 needs persistent="):
        fop.CheckpointManager(tmp_path / "run", persistent_every=5)
    assert not (tmp_path / "run").exists()
    # The callback takes it among its manager's options (a misspelling is named there).
    fop.CheckpointCallback(tmp_path / "run", manager_options={"persistent_every": 5})
    with pytest.raises(TypeError, match=r"did you mean persistent_every="):
        fop.CheckpointCallback(tmp_path / "run", manager_options={"persistent_evry": 5})
