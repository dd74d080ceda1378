"""Options checked at construction by their public names (issue 25)."""

from __future__ import annotations

import os
import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._manager.checkpointables import PytreeCheckpointable

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


def test_a_misspelt_manager_option_names_where_it_was_given(tmp_path):
    # It read "CheckpointManager (through manager_options)() got an unexpected ...".
    with pytest.raises(TypeError) as info:
        fop.CheckpointCallback(tmp_path / "run", manager_options={"incremntal": True})
    assert str(info.value).startswith(
        "manager_options: CheckpointManager() got an unexpected keyword argument "
        "'incremntal': did you mean incremental=?"
    )


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
    with pytest.raises(
        fop.OptionError, match=r"^persistent_every=5 does nothing without persistent="
    ):
        fop.CheckpointManager(tmp_path / "run", persistent_every=5)
    assert not (tmp_path / "run").exists()
    # The callback checks its manager's options when it is made, not at the first save.
    with pytest.raises(fop.OptionError, match=r"^persistent_every=5 does nothing without persis"):
        fop.CheckpointCallback(tmp_path / "run", manager_options={"persistent_every": 5})
    with pytest.raises(TypeError, match=r"did you mean persistent_every="):
        fop.CheckpointCallback(tmp_path / "run", manager_options={"persistent_evry": 5})


# -- issue 32: every public option checked by its declaration, hostile values ------------

NAN, INF = float("nan"), float("inf")


class _NoWriter:
    def __repr__(self):  # a stable test id (pytest-xdist workers must agree)
        return "_NoWriter()"


def _p(tmp_path):
    return {"persistent": str(tmp_path / "p")}


def _best(tmp_path):
    return {"keep_best": 1, "best_metric": "loss"}


# (option, hostile value, other options it needs to be meaningful, words of the message)
MANAGER_CASES = [
    ("keep", "3", None, "a positive int or None, found str '3'"),
    ("keep", -1, None, "found int -1"),
    ("keep", NAN, None, "found float nan"),
    ("keep", 2.5, None, "found float 2.5"),
    ("keep", "", None, "found str ''"),
    ("keep_every", -5, None, "a positive int"),
    ("keep_every", "x", None, "found str 'x'"),
    ("keep_best", 0, lambda t: {"best_metric": "loss"}, "found int 0"),
    (
        "best_metric",
        "",
        lambda t: {"keep_best": 1},
        "a key of the extras (a str) or None, found str",
    ),
    ("best_metric", 5, lambda t: {"keep_best": 1}, "found int 5"),
    ("best_mode", "mx", _best, "one of 'min', 'max', found str 'mx' (did you mean 'max'?)"),
    ("best_mode", "", _best, "one of 'min', 'max'"),
    ("best_mode", None, _best, "found NoneType None"),
    ("every_steps", 0, None, "a positive int or None"),
    ("every_steps", NAN, None, "found float nan"),
    ("every_steps", "10", None, "found str '10'"),
    ("every_seconds", NAN, None, "a number of seconds > 0"),
    ("every_seconds", INF, None, "found float inf"),
    ("every_seconds", -1, None, "found int -1"),
    ("every_seconds", 1e300, None, "found float 1e+300"),
    ("every_seconds", "60", None, "found str '60'"),
    ("steps", 5, None, "iterable of int steps, found int 5"),
    ("steps", "12", None, "found str '12'"),
    ("steps", [1, -2], None, "steps must be an int >= 0, found int -2"),
    ("steps", [1.5], None, "steps must be an int >= 0, found float 1.5"),
    ("async_save", "no", None, "True or False, found str 'no'"),
    ("async_save", 1, None, "found int 1"),
    ("read_only", "yes", None, "True or False"),
    ("handle_sigterm", None, None, "True or False, found NoneType"),
    ("incremental", "true", None, "True or False"),
    ("reuse_host_buffers", 0, None, "True or False"),
    ("checkpointables", ["params"], None, "dict {item name: Checkpointable}, found list"),
    ("checkpointables", {"params": 3}, None, "checkpointables['params']: expected a Checkpoint"),
    ("clock", 5, lambda t: {"every_seconds": 1}, "a callable, found int 5"),
    ("compression", "zstd", None, "found str 'zstd' (e.g. {'params': 'zstd'})"),
    ("compression", {"params": "lz4"}, None, "compression['params']: expected None, 'zstd'"),
    ("compression", {"params": ""}, None, "found ''"),
    ("compression", {"../x": "zstd"}, None, "invalid item name '../x' in compression"),
    ("compression", 3, None, "found int 3"),
    ("format_version", 3, None, "one of 1, 2 or None, found int 3"),
    ("format_version", "2", None, "found str '2'"),
    ("format_version", True, None, "found bool True"),
    ("format_version", 2.0, None, "found float 2.0"),
    ("host_memory", 0, None, "a positive int of bytes <= 9223372036854775807, found 0"),
    ("host_memory", "1GB", None, "expected a positive int of bytes, 'auto' or None, found str"),
    ("host_memory", NAN, None, "found float nan"),
    ("host_memory_budget", 0, None, "a positive int <= 9223372036854775807 or None"),
    ("persistent", "", None, "expected a path or URL, found str ''"),
    ("persistent", 5, None, "kvstore dict, found int 5"),
    ("persistent_keep", 0, _p, "a positive int or None"),
    ("persistent_keep_every", "x", _p, "found str 'x'"),
    ("persistent_every", -1, _p, "a positive int, found int -1"),
    ("persistent_grace_seconds", -1, _p, "a number of seconds >= 0"),
    ("persistent_grace_seconds", NAN, _p, "found float nan"),
    ("persistent_grace_seconds", 1e300, _p, "found float 1e+300"),
    ("persistent_lease_seconds", 0, _p, "a number of seconds >= 1"),
    ("persistent_lease_seconds", NAN, _p, "found float nan"),
    ("persistent_lease_seconds", 1e30, _p, "<= 3.16224e+07, found float 1e+30"),
    ("persistent_lease_seconds", "60", _p, "found str '60'"),
]


def _case_id(case):
    return f"{case[0]}={case[1]!r}"


@pytest.mark.parametrize(
    "name, value, needs, words", MANAGER_CASES, ids=map(_case_id, MANAGER_CASES)
)
def test_every_manager_option_refuses_a_hostile_value(tmp_path, name, value, needs, words):
    extra = needs(tmp_path) if needs else {}
    with pytest.raises(fop.OptionError) as info:
        fop.CheckpointManager(tmp_path / "run", **extra, **{name: value})
    assert str(info.value).startswith(name), info.value
    assert words in str(info.value), info.value
    assert not (tmp_path / "run").exists()  # refused before anything was made
    # The callback checks the same options in manager_options when it is made.
    if not {name, *extra} & {"keep", "every_steps", "every_seconds", "async_save", "host_memory"}:
        with pytest.raises(fop.OptionError, match=rf"^{name}"):
            fop.CheckpointCallback(tmp_path / "run", manager_options={**extra, name: value})


def test_compression_as_a_string_is_an_option_error(tmp_path):
    # Was an AttributeError ('str' object has no attribute 'items').
    with pytest.raises(fop.OptionTypeError, match=r"^compression: expected a dict .* found str"):
        fop.CheckpointManager(tmp_path / "run", compression="zstd")
    with pytest.raises(TypeError):  # an OptionTypeError is a TypeError, and a ValueError
        fop.CheckpointManager(tmp_path / "run", compression="zstd")


CALLBACK_CASES = [
    ("every_steps", 0, "a positive int or None"),
    ("every_seconds", NAN, "found float nan"),
    ("keep", "3", "found str '3'"),
    ("resume", "requried", "(did you mean 'required'?)"),
    ("resume", 1, "one of False, True, 'required', found int 1"),
    ("resume", None, "found NoneType None"),
    ("overwrite", "no", "True or False"),
    ("async_save", None, "True or False"),
    ("state_fn", 5, "a callable or None, found int 5"),
    ("extras_fn", "f", "found str 'f'"),
    ("writer", _NoWriter(), "write_scalars(step, scalars)"),
    ("manager_options", ["keep"], "a dict of CheckpointManager options, found list"),
]


@pytest.mark.parametrize("name, value, words", CALLBACK_CASES, ids=map(_case_id, CALLBACK_CASES))
def test_every_callback_option_refuses_a_hostile_value(tmp_path, name, value, words):
    with pytest.raises(fop.OptionError) as info:
        fop.CheckpointCallback(tmp_path / "run", **{name: value})
    assert str(info.value).startswith(name) and words in str(info.value), info.value


# -- issue 32: an option that does nothing in the chosen mode is refused ------------------

IDLE_MANAGER = [
    ({"persistent_keep": 1}, "persistent_keep=1 does nothing without persistent="),
    ({"persistent_keep_every": 10}, "persistent_keep_every=10 does nothing without persistent="),
    ({"persistent_grace_seconds": 5}, "persistent_grace_seconds=5.0 does nothing without pers"),
    ({"persistent_lease_seconds": 10}, "persistent_lease_seconds=10.0 does nothing without pers"),
    (
        {"persistent": "P", "persistent_lease_seconds": 10},
        "persistent_lease_seconds=10.0 does nothing without a persistent tier on an object store",
    ),
    (
        {"persistent": "P", "persistent_keep_every": 10},
        "persistent_keep_every=10 does nothing without persistent_keep=",
    ),
    ({"keep_every": 10}, "keep_every=10 does nothing without keep= or keep_best="),
    (
        {"incremental": True, "host_memory": 1 << 20},
        "host_memory=1048576 does nothing without incremental=False",
    ),
    (  # a ceiling of bytes pools nothing: the option was silently ignored
        {"host_memory": 1 << 20, "reuse_host_buffers": True},
        "reuse_host_buffers=True does nothing without host_memory=None or 'auto'",
    ),
    ({"best_mode": "max"}, "best_mode='max' does nothing without keep_best= and best_metric="),
    ({"clock": lambda: 0.0}, "does nothing without every_seconds="),
    ({"read_only": True, "keep": 2}, "keep=2 does nothing without a writer (read_only=False)"),
    ({"read_only": True, "every_steps": 5}, "every_steps=5 does nothing without a writer"),
    ({"read_only": True, "steps": [3]}, "steps=[3] does nothing without a writer"),
    ({"read_only": True, "incremental": True}, "incremental=True does nothing without a writer"),
    ({"read_only": True, "async_save": False}, "async_save=False does nothing without a writer"),
    ({"read_only": True, "format_version": 2}, "format_version=2 does nothing without a writer"),
    ({"read_only": True, "compression": {"params": "zstd"}}, "compression={'params': 'zstd'} d"),
    ({"read_only": True, "reuse_host_buffers": True}, "reuse_host_buffers=True does nothing"),
]


@pytest.mark.parametrize(
    "options, words", IDLE_MANAGER, ids=[str(sorted(o)) for o, _ in IDLE_MANAGER]
)
def test_an_option_that_does_nothing_in_the_mode_is_refused(tmp_path, options, words):
    options = {k: str(tmp_path / "p") if v == "P" else v for k, v in options.items()}
    idle = list(options)[-1]  # the option that does nothing here
    (tmp_path / "run").mkdir()  # a reader needs a directory
    with pytest.raises(fop.OptionError, match=re.escape(words)) as info:
        fop.CheckpointManager(tmp_path / "run", **options)
    assert str(info.value).startswith(f"{idle}="), info.value
    assert os.listdir(tmp_path / "run") == [] and not (tmp_path / "p").exists()
    if not {"read_only", "clock", "keep_every", "host_memory"} & set(options):  # (callback: own)
        with pytest.raises(fop.OptionError, match="^" + re.escape(words)):
            fop.CheckpointCallback(tmp_path / "run", manager_options=options)


def test_a_tiers_grace_does_nothing_without_handle_sigterm(tmp_path):
    """The grace is how long the exit after SIGTERM waits for the bucket: refused when
    nothing exits on SIGTERM; taken with handle_sigterm=True."""
    tier = fop.Tier(str(tmp_path / "p"), grace_seconds=5)
    with pytest.raises(fop.OptionError, match=r"^Tier\(grace_seconds\)=5.0 does nothing"):
        fop.CheckpointManager(tmp_path / "run", persistent=tier)
    fop.CheckpointManager(tmp_path / "run", persistent=tier, handle_sigterm=True).close()


def test_the_modes_that_use_those_options_still_take_them(tmp_path):
    with fop.CheckpointManager(
        tmp_path / "a", keep=1, keep_every=2, persistent=str(tmp_path / "p"), persistent_keep=1,
        persistent_keep_every=5, persistent_grace_seconds=5, every_seconds=1, clock=lambda: 0.0,
        handle_sigterm=True,
    ):  # fmt: skip
        pass
    with fop.CheckpointManager(tmp_path / "b", keep_best=1, best_metric="loss", best_mode="max"):
        pass
    fop.CheckpointManager(tmp_path / "a", read_only=True, checkpointables={})


def test_callback_options_that_do_nothing_or_collide_are_refused(tmp_path):
    with pytest.raises(fop.OptionError, match=r"^overwrite=True does nothing without resume=F"):
        fop.CheckpointCallback(tmp_path / "run", resume=True, overwrite=True)
    # Was: manager_options silently replaced the callback's own keep=.
    with pytest.raises(fop.OptionError, match=r"manager_options\['keep'\]: keep is an option of"):
        fop.CheckpointCallback(tmp_path / "run", keep=2, manager_options={"keep": 5})
    fop.CheckpointCallback(tmp_path / "run", resume=False, overwrite=True)  # taken


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"force": "yes"}, "force must be True or False, found str 'yes'"),  # was: taken
        ({"overwrite": "x"}, "overwrite must be True or False, found str 'x'"),  # was: taken
        ({"t": NAN}, "t must be a time in seconds (a finite number) or None, found float nan"),
        ({"t": "now"}, "t must be a time in seconds (a finite number) or None, found str 'now'"),
        ({"step": 1.5}, "step must be an int step in [0, 999999999999999999], found float 1.5"),
        ({"step": -1}, "step must be an int step in [0, 999999999999999999], found int -1"),
        ({"step": "7"}, "step must be an int step in [0, 999999999999999999], found str '7'"),
    ],
)
def test_manager_save_refuses_a_hostile_keyword(tmp_path, kwargs, words):
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        step = kwargs.pop("step", 1)
        with pytest.raises(fop.OptionError, match="^" + re.escape(words)):
            mngr.save(step, {"params": {"w": np.zeros(4)}}, **kwargs)
        assert mngr.steps() == []
        assert mngr.save(np.int64(2), {"params": {"w": np.zeros(4)}})  # integer scalars
        assert mngr.save(jnp.asarray(3), {"params": {"w": np.zeros(4)}})
        mngr.wait()
        assert mngr.steps() == [2, 3]


@pytest.mark.parametrize(
    "directory, words",
    [
        ("", "directory: expected a path or URL, found str ''"),  # was: the working directory
        (5, "directory: expected a path, an s3:// / gs:// URL or a kvstore dict, found int 5"),
    ],
)
def test_the_manager_directory_is_checked_as_an_option(directory, words):
    with pytest.raises(fop.OptionError, match="^" + re.escape(words)):
        fop.CheckpointManager(directory)


def test_compression_of_an_item_with_its_own_checkpointable_is_refused(tmp_path):
    with pytest.raises(fop.OptionError, match=r"^compression\['params'\] does nothing: item 'p"):
        fop.CheckpointManager(
            tmp_path / "run",
            checkpointables={"params": PytreeCheckpointable()},
            compression={"params": "zstd"},
        )


@pytest.mark.parametrize("name", ["directory", "persistent"])
@pytest.mark.parametrize(
    "place, words",
    [
        ("gs://", "{name} 'gs://': expected gs://<bucket>/<path>, found no bucket"),
        ({"path": "x"}, "{name}: a kvstore spec needs a 'driver'"),
    ],
)
def test_what_a_path_option_names_is_checked_by_the_path_checker(tmp_path, name, place, words):
    # Refused with the option's name where it enters (a persistent= was only opened later).
    options = {"directory": tmp_path / "run", name: place}
    with pytest.raises(
        fop.UnsupportedLocationError, match="^" + re.escape(words.format(name=name))
    ):
        fop.CheckpointManager(options.pop("directory"), **options)
    assert not (tmp_path / "run").exists()


def test_a_compression_or_checkpointable_naming_no_item_of_the_first_save_warns_once(tmp_path):
    """compression={"param": ...} for items named params did nothing, silently."""
    tree = {"params": {"w": np.zeros(4)}}
    with fop.CheckpointManager(tmp_path / "a", compression={"param": "zstd"}) as mngr:
        with pytest.warns(UserWarning, match=r"'param', which this save does not hold.*params"):
            mngr.save(1, tree)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mngr.save(2, tree)  # once
    with fop.CheckpointManager(tmp_path / "b", compression={"params": "zstd"}) as mngr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mngr.save(1, tree)  # a name that matches: no word


@pytest.mark.parametrize("item", ["step", "extras", "data_iterator"])
def test_compression_of_a_json_item_is_refused(tmp_path, item):
    with pytest.raises(fop.OptionError, match=rf"compression\['{item}'\] does nothing: .*JSON"):
        fop.CheckpointManager(tmp_path / "run", compression={item: "zstd"})
    fop.CheckpointManager(tmp_path / "run", compression={"params": "zstd"}).close()


def test_a_callbacks_manager_is_never_read_only(tmp_path):
    """Refused as such (it said keep=3, the callback's default, does nothing); the
    message for a Lanes with a retention shorthand is test_policies'."""
    with pytest.raises(fop.OptionError, match=r"a CheckpointCallback saves"):
        fop.CheckpointCallback(tmp_path / "b", manager_options={"read_only": True})
