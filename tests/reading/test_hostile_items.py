"""Hostile JSON items (issue 32, the red-team pass over JSON items pointed at on their
own): a value nested deeper than the one JSON depth limit, or holding itself, is
refused at save time with an error naming the item (on the branch's base it raised a raw
RecursionError, or committed a step whose ``fop.restore(DIR/<step>/extras)`` raised
RecursionError while ``verify`` called it ok; main's json_docs now holds the limit, and
these cases stay as its table); a committed file past that limit (a crafted one) is
damage in every reader and in verify; ``flax-orbax list`` of a step whose extras hold an int past
a float's range shows it (it died on an OverflowError)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._format import steps as _steps
from flax_orbax_plugin._storage.location import Location

LIMIT = 100  # the documented limit (FORMAT.md, json_docs.JSON_ITEM)
TREE = {"params": {"w": np.ones(2, np.float32)}}


def nested(levels, leaf=0):
    value = leaf
    for _ in range(levels):  # ``levels`` objects around ``leaf``
        value = {"a": value}
    return value


def cyclic():
    value: dict = {"loss": 1.0}
    value["self"] = value
    return value


class DeepIterator:
    def __init__(self, state):
        self.state = state

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


TOO_DEEP = [
    ("extras", lambda: {"extras": nested(LIMIT + 1)}),
    ("extras", lambda: {"extras": nested(500)}),
    ("extras", lambda: {"extras": nested(5000)}),
    ("extras", lambda: {"extras": cyclic()}),
    ("extras", lambda: {"extras": nested(LIMIT, b"bytes")}),  # its tag is one level more
    ("extras", lambda: {"extras": nested(LIMIT - 1, np.ones((2, 2)))}),  # rows nest too
    ("data_iterator", lambda: {"data_iterator": DeepIterator(nested(LIMIT))}),  # {"state":}
]
IDS = ["limit+1", "500", "5000", "cycle", "bytes-at-limit", "array-at-limit", "iterator"]


@pytest.fixture(params=["local", "memory"])
def directory(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://hostile-items/{tmp_path.name}"


@pytest.mark.parametrize("item,kwargs", TOO_DEEP, ids=IDS)
def test_too_deep_is_refused_at_save_and_nothing_commits(directory, item, kwargs):
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        with pytest.raises((ValueError, fop.CheckpointError), match=rf"{item}.*nested"):
            mngr.save(1, TREE, **kwargs())
        assert mngr.latest_step() is None


def test_the_limit_itself_round_trips_through_every_reader(directory, capsys):
    value = nested(LIMIT, "leaf")
    it = DeepIterator(nested(LIMIT - 1, "leaf"))
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        mngr.save(1, TREE, extras=value, data_iterator=it)
    assert fop.restore(f"{directory}/1/extras") == value
    with fop.CheckpointManager(directory, read_only=True) as mngr:
        assert mngr.restore(items=("extras",)) == {"extras": value}
        back = DeepIterator(None)
        mngr.restore(like=None, items=("data_iterator",), data_iterator=back)
        assert back.state == it.state
    assert cli.main(["verify", directory]) == 0
    assert cli.main(["inspect", f"{directory}/1/extras"]) == 0
    capsys.readouterr()


def _craft(run, levels):
    """A committed step whose extras file nests ``levels`` deep, its manifest re-sealed
    with the file's checksum (what only a hand or another writer makes)."""
    with fop.CheckpointManager(run, async_save=False) as mngr:
        mngr.save(1, TREE, extras={"loss": 1.0})
    step = Location.from_path(run).child("1")
    raw = json.dumps(nested(levels)).encode()
    (run / "1" / "extras" / _layout.JSON_VALUE_FILE).write_bytes(raw)
    manifest = _layout.read_manifest(step)
    files = dict(manifest.files, **{f"extras/{_layout.JSON_VALUE_FILE}": _layout.sha256(raw)})
    _steps.write_manifest(step, dataclasses.replace(manifest, files=files))


READERS = {
    "restore": lambda run: fop.restore(run / "1" / "extras"),
    "manager": lambda run: fop.CheckpointManager(run, read_only=True).restore(items=("extras",)),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("levels", [LIMIT + 1, 600])
def test_a_crafted_deep_file_is_damage_for_every_reader(tmp_path, reader, levels):
    run = tmp_path / "run"
    _craft(run, levels)
    with pytest.raises(
        fop.CorruptCheckpointError, match=r"extras/value.json: nested \d+ levels deep"
    ):
        READERS[reader](run)


def test_a_crafted_deep_file_is_damaged_in_verify(tmp_path, capsys):
    run = tmp_path / "run"
    _craft(run, 600)
    assert cli.main(["verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "nested 600 levels deep" in out


def test_list_shows_an_int_metric_past_a_floats_range(tmp_path, capsys):
    run = tmp_path / "run"
    with fop.CheckpointManager(run, async_save=False) as mngr:
        mngr.save(1, TREE, extras={"tokens": 10**400, "loss": 0.5})
    assert cli.main(["list", str(run)]) == 0
    out = capsys.readouterr()
    assert "tokens=1.000e+400" in out.out and "loss=0.5" in out.out, out


@pytest.mark.parametrize("reader", [fop.restore, fop.metadata], ids=["restore", "metadata"])
def test_a_step_of_json_items_only_names_items_it_has(tmp_path, reader):
    """It pointed at DIR/<step>/params, which such a step does not have."""
    run = tmp_path / "run"
    with fop.CheckpointManager(run, async_save=False) as mngr:
        mngr.save(1, {"step": 1, "meta": {"a": 1}}, extras={"x": 1})
    with pytest.raises(fop.CheckpointError, match="not one pytree") as info:
        reader(run / "1")
    message = str(info.value)
    assert f"{run}/1/meta" in message and f"{run}/1/extras" in message
    assert "/params" not in message
    assert fop.restore(run / "1" / "meta") == {"a": 1}  # a path it names reads


def _with_item_linked_out(tmp_path):
    """A committed step whose extras folder was replaced by a symlink to a folder outside
    holding the very same value.json (so no checksum can tell)."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    with fop.CheckpointManager(run, async_save=False) as mngr:
        mngr.save(1, TREE, extras={"loss": 1.0})
    shutil.copytree(run / "1" / "extras", outside)
    shutil.rmtree(run / "1" / "extras")
    os.symlink(outside, run / "1" / "extras")
    return run


LINKED_READERS = {
    "restore": lambda run: fop.restore(run / "1" / "extras"),
    "metadata": lambda run: fop.metadata(run / "1" / "extras"),
    "manager": lambda run: fop.CheckpointManager(run, read_only=True).restore(items=("extras",)),
    "restore_params": lambda run: fop.restore_params(run),
}


@pytest.mark.parametrize("reader", sorted(LINKED_READERS))
def test_an_item_folder_that_is_a_symlink_is_never_followed(tmp_path, reader):
    """The readers followed the link and returned the outside folder's value."""
    run = _with_item_linked_out(tmp_path)
    with pytest.raises(fop.ForeignEntryError, match=r"folder of item 'extras'.*symbolic link"):
        LINKED_READERS[reader](run)


def test_verify_calls_a_symlinked_item_folder_damaged(tmp_path, capsys):
    run = _with_item_linked_out(tmp_path)
    assert cli.main(["verify", str(run)]) == 1
    out = capsys.readouterr()
    assert "symbolic link (never followed or read)" in out.out
    assert "damaged: 1\n" in out.err  # the step, not "1/None"
