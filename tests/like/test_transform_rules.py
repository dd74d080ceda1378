"""The transform= option is checked once where it enters (issue 32): a replacement
naming a group its pattern lacks, a bad escape, a pattern that is no regex or a value
of the wrong type is a TransformError naming the entry, before anything is read,
through every restore entry point."""

from __future__ import annotations

import numpy as np
import pytest

import flax_orbax_plugin as fop

BAD = [
    # (transform, what the message must name)
    (
        {r"layers_(\d+)": r"block\2"},
        r"transform\['layers_.*'\]: the replacement .*group reference 2",
    ),
    ({r"layers_(\d+)": r"\g<idx>"}, r"unknown group name 'idx'.*1 group \(\\1\)"),
    ({r"(?P<n>\d)": r"\g<m>"}, r"unknown group name 'm'.*named 'n'"),
    ({r"layers": r"\q"}, r"bad escape \\q.*no groups"),
    ({r"layers_(": "block"}, r"transform\['layers_\('\]: the pattern is not a regex"),
    ({3: "block"}, r"every key is a regex pattern \(a str\); found int 3"),
    ({r"layers": ["block"]}, r"transform\['layers'\]: expected a replacement str.*found list"),
    (("layers", "block"), r"expected a dict \{regex: replacement\}.*found tuple"),
]
IDS = ["group-number", "group-name", "named-group", "bad-escape", "bad-regex"]
IDS += ["key-type", "value-type", "option-type"]


def tree():
    return {"params": {"layers_0": {"w": np.ones(2, np.float32)}}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("rules") / "run"
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        mngr.save(1, tree())
    return directory


def through_restore(run, transform):
    fop.restore(run / "1" / "params", tree()["params"], transform=transform)


def through_manager(run, transform):
    with fop.CheckpointManager(run, read_only=True) as mngr:
        mngr.restore(like=tree(), transform=transform)


def through_callback(run, transform):
    cb = fop.CheckpointCallback(run, resume=True)
    try:
        cb.on_train_start(tree(), transform=transform)
    finally:
        cb.close()


def through_restore_params(run, transform):
    fop.restore_params(run, tree()["params"], transform=transform)


ENTRY_POINTS = [through_restore, through_manager, through_callback, through_restore_params]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("transform,message", BAD, ids=IDS)
def test_bad_transform_is_named_at_every_entry_point(run, entry, transform, message):
    with pytest.raises(fop.TransformError, match=message) as info:
        entry(run, transform)
    assert isinstance(info.value, fop.CheckpointError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "entry",
    [
        lambda d, t: fop.restore(d / "nothing", tree(), transform=t),
        lambda d, t: fop.restore_params(d / "nothing", transform=t),
        lambda d, t: fop.CheckpointCallback(d / "nothing", resume=True).on_train_start(
            tree(), transform=t
        ),
    ],
    ids=["restore", "restore_params", "callback"],
)
def test_checked_before_anything_is_read(tmp_path, entry):
    """A missing checkpoint would raise CheckpointNotFoundError, a callback with nothing
    to resume would start fresh: the option is refused first."""
    with pytest.raises(fop.TransformError, match="invalid group reference 2"):
        entry(tmp_path, {r"(a)": r"\2"})


def test_good_templates_still_apply(run):
    like = {"params": {"block_0": {"w": np.zeros(2, np.float32)}}}
    rules = [
        {r"layers_(\d+)": r"block_\1"},
        {r"layers_(?P<i>\d+)": r"block_\g<i>"},
        {r"layers_(\d+)": r"block_\g<1>"},
        {r"(x)?layers_": r"\1block_"},  # an unmatched group expands to ''
    ]
    with fop.CheckpointManager(run, read_only=True) as mngr:
        for rule in rules:
            out = mngr.restore(like=like, transform=rule)
            np.testing.assert_array_equal(out["params"]["block_0"]["w"], np.ones(2))


def test_callable_returning_a_non_path_is_named(run):
    with pytest.raises(fop.TransformError, match=r"transform\('layers_0/w'\) returned int 3"):
        fop.restore_params(run, tree()["params"], transform=lambda p: 3)
