"""Options by kind, wherever they enter: numpy scalars are the Python values they hold
(np.int64(2) an int, np.True_ a flag), while 1 or "no" is no flag; a bad value is an
OptionError / OptionTypeError naming the option, checked before anything starts."""

from __future__ import annotations

import numpy as np
import pytest

import flax_orbax_plugin as fop


def test_numpy_scalars_are_the_values_they_hold(tmp_path):
    fop.save(tmp_path / "a", {"x": np.ones(3)}, format_version=np.int64(2), force=np.True_)
    assert fop.metadata(tmp_path / "a").format_version == 2
    with fop.CheckpointManager(
        tmp_path / "run", format_version=np.int64(1), async_save=np.False_
    ) as mngr:
        mngr.save(np.int64(3), {"params": {"w": np.ones(2)}})
        assert mngr.steps() == [3]


@pytest.mark.parametrize("value", [1, "no", np.int64(1), None])
def test_a_flag_takes_true_or_false_only(tmp_path, value):
    fop.save(tmp_path / "a", {"x": np.ones(3)})
    with pytest.raises(fop.OptionTypeError, match=r"dry_run must be True or False"):
        fop.restore(tmp_path / "a", dry_run=value)
    with pytest.raises(fop.OptionTypeError, match=r"force must be True or False"):
        fop.save(tmp_path / "a", {"x": np.ones(3)}, force=value)
    with pytest.raises(fop.OptionTypeError, match=r"dry_run must be True or False"):
        fop.restore_params(tmp_path / "a", dry_run=value)


@pytest.mark.parametrize("timeout", ["1", float("nan"), -1, [1]])
def test_a_bad_wait_timeout_leaves_the_save_running(tmp_path, timeout):
    """Before, a str timeout raised numpy's TypeError inside wait, which took it for an
    interruption: the save was cancelled, and the next wait raised KeyboardInterrupt."""
    handle = fop.save_async(tmp_path / "b", {"x": np.ones(1 << 20)})
    with pytest.raises((fop.OptionError, fop.OptionTypeError), match=r"^timeout must be"):
        handle.wait(timeout=timeout)
    handle.wait()
    assert fop.is_committed(tmp_path / "b")


def test_a_range_of_steps_stays_a_range(tmp_path):
    """Before, steps=range(10**12) was expanded into a set: the manager never opened."""
    with fop.CheckpointManager(tmp_path, steps=range(0, 10**12, 7), async_save=False) as mngr:
        assert mngr.should_save(7 * 10**9) and not mngr.should_save(7 * 10**9 + 1)
    assert fop.AtSteps(range(5, 10**12, 5)).steps == range(5, 10**12, 5)
    with pytest.raises(fop.OptionError, match=r"steps >= 0"):
        fop.AtSteps(range(-1, 5))
    with pytest.raises(fop.OptionError, match=r"more than 1,000,000 steps one by one"):
        fop.AtSteps(i for i in range(10**12))


def test_every_seconds_has_one_limit_whatever_its_form(tmp_path):
    """Before, the shorthand took 5e9 s and the first save raised, naming EverySeconds."""
    for make in (
        lambda: fop.CheckpointManager(tmp_path, every_seconds=5e9),
        lambda: fop.SavePolicy(every_seconds=5e9),
        lambda: fop.EverySeconds(5e9),
    ):
        with pytest.raises(fop.OptionError, match=r"<= 1e\+09"):
            make()


def test_a_lease_too_short_to_renew_without_hammering_the_store_is_refused():
    """Before, lease_seconds=0.003 renewed the record every millisecond: 562 PUTs and
    561 HEADs on the S3 server during one save."""
    with pytest.raises(fop.OptionError, match=r"lease_seconds must be a number of seconds >= 1"):
        fop.Tier("s3://bucket/run", lease_seconds=0.003)
    assert fop.Tier("s3://bucket/run", lease_seconds=1).lease_seconds == 1


def test_callback_options_are_checked_when_it_is_made(tmp_path):
    """Before, these constructed and failed at on_train_start or at the first save due."""
    for directory in (None, "", 5, "~/x"):
        with pytest.raises(fop.UnsupportedLocationError):
            fop.CheckpointCallback(directory)
    with pytest.raises(fop.OptionTypeError, match=r"data_iterator: a int has neither"):
        fop.CheckpointCallback(tmp_path, data_iterator=5)
    cb = fop.CheckpointCallback(tmp_path, every_steps=1, extras_fn=lambda step, state: 5)
    cb.on_train_start({"params": {"w": np.ones(2)}})
    with pytest.raises(fop.OptionTypeError, match=r"what extras_fn returned.*found int 5"):
        cb.on_step_end(1, {"params": {"w": np.ones(2)}})
    with pytest.raises(fop.OptionTypeError, match=r"made without state_fn="):
        fop.CheckpointCallback(tmp_path / "b")(3)


def test_manager_inputs_are_the_librarys_errors(tmp_path):
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        with pytest.raises(fop.StructureError, match="nothing to save"):
            mngr.save(1, None)
        with pytest.raises(fop.StructureError, match="invalid checkpointable name"):
            mngr.save(1, {"_x": np.ones(2)})
        mngr.save(1, {"params": {"w": np.ones(2)}})
        mngr.wait()
        with pytest.raises(fop.OptionError, match="items names no item"):
            mngr.restore(items=[])  # it returned {} without a word
        with pytest.raises(fop.OptionTypeError, match="include_persistent must be True or"):
            mngr.latest_step(include_persistent=1)
    for nested in (tmp_path / "run" / "up", tmp_path):
        with pytest.raises(fop.OptionError, match="nested with the local directory"):
            fop.CheckpointManager(tmp_path / "run", persistent=str(nested))


def test_tree_and_surgery_inputs_are_named(tmp_path):
    fop.save(tmp_path / "ck", {"x": np.ones(3)})
    for like in (object(), 5):  # said "leaf '<root>': expected by like, found no such key"
        with pytest.raises(fop.StructureError, match=r"like is one leaf .*not a tree.*\['x'\]"):
            fop.restore(tmp_path / "ck", like=like)
    with pytest.raises(fop.TransformError, match=r"sources must be distinct.*'b' is there twice"):
        fop.Fuse("f", ["b", "b"], 0)  # restore said 'b' was missing (the first use took it)
    with pytest.raises(fop.TransformError, match=r"targets must be distinct"):
        fop.Split("a", ["b", "b"], 0)
    assert type(fop.Split("a", ["b", "c"], axis=np.int64(1)).axis) is int
    with pytest.raises(fop.OptionTypeError, match=r"make_batch must be a callable"):
        fop.StepIndexedIterator(5)  # it failed at next(): 'int' object is not callable
    it = fop.StepIndexedIterator(make_epoch=lambda e: [e], num_epochs=np.int64(2))
    assert list(it) == [0, 1]


def test_an_importers_progress_is_checked_before_it_reads(tmp_path):
    """Before: 'int' object is not callable, from inside the import."""
    for importer in (fop.import_msgpack, fop.import_orbax):
        with pytest.raises(fop.OptionTypeError, match=r"^progress must be a callable or None"):
            importer(tmp_path / "missing", tmp_path / "out", progress=5)


def test_restore_orbax_checks_its_options_by_kind(tmp_path):
    """Before: allow_cast=1 was a yes, and step='x' said 'no finalized Orbax step x'."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, args=ocp.args.StandardSave({"w": np.ones(3, np.float32)}))
        mngr.wait_until_finished()
    with pytest.raises(fop.OptionTypeError, match=r"^allow_cast must be True or False"):
        fop.restore_orbax(tmp_path / "run", allow_cast=1)
    with pytest.raises(fop.OptionError, match=r"^cast must be one of"):
        fop.restore_orbax(tmp_path / "run", cast="yes")
    narrow = {"default": {"w": np.zeros(3, np.int8)}}
    with pytest.raises(fop.StructureError, match=r"pass cast='unsafe'"):
        fop.restore_orbax(tmp_path / "run", narrow)
    assert (
        fop.restore_orbax(tmp_path / "run", narrow, cast="unsafe")["default"]["w"].dtype == np.int8
    )
    with pytest.raises(fop.OptionTypeError, match=r"^step must be"):
        fop.restore_orbax(tmp_path / "run", step="x")
    got = fop.restore_orbax(tmp_path / "run", step=np.int64(1), partial=np.False_)
    np.testing.assert_array_equal(got["default"]["w"], np.ones(3, np.float32))


def test_processes_compare_a_range_of_steps_by_its_bounds():
    """The options every process must share are compared as JSON: a range is its
    bounds (it compared as {'type': 'range'}, equal whatever its steps)."""
    from flax_orbax_plugin._manager.housekeeping import _describe

    one = _describe(fop.SavePolicy(steps=range(0, 100, 7)))
    assert one != _describe(fop.SavePolicy(steps=range(0, 100, 5)))
    assert one == _describe(fop.SavePolicy(steps=range(0, 100, 7)))
