"""What is at a path, classified once (``_format.steps.classify``, issue 52): one frozen
value per kind, its description ready for messages, and the reading fronts
(``fop.restore``, ``fop.metadata``, ``restore_params``, ``fop.verify``) dispatching on it
instead of trying the native reader and catching its errors."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import restore as _core_restore
from flax_orbax_plugin._format import steps as _places
from flax_orbax_plugin._format.layout import HOST_FILE
from flax_orbax_plugin._storage.location import Location


@pytest.fixture
def world(tmp_path):
    """Every kind of place, written by the library itself where it writes that kind."""
    fop.save(tmp_path / "ckpt", {"w": np.arange(3.0)})
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(2, {"params": {"w": np.ones(2)}}, extras={"loss": 0.5})
    shutil.copytree(tmp_path / "run" / "2", tmp_path / "hosts" / "2")
    (tmp_path / "hosts" / "2" / HOST_FILE).write_text("{}")  # a host's copy: by its marker
    (tmp_path / "orbax" / "7").mkdir(parents=True)  # an Orbax run, by its file names
    (tmp_path / "orbax" / "7" / "_CHECKPOINT_METADATA").write_text(json.dumps({}))
    (tmp_path / "state.msgpack").write_bytes(b"\x81\xa1w\x01")  # a msgpack map
    (tmp_path / "staged").mkdir()
    (tmp_path / "staged" / "_METADATA.json").write_text("{}")  # written before its commit
    (tmp_path / "empty").mkdir()
    return tmp_path


KINDS = {
    "ckpt": (_places.CHECKPOINT, "the checkpoint {p} (written by fop.save)"),
    "run": (_places.RUN, "the run directory {p} (latest step 2)"),
    "run/2": (_places.STEP_KIND, "step 2 of the run directory {r}/run"),
    "hosts/2": (_places.HOST_COPY, "one host's own copy of step 2 ({p})"),
    "run/2/params": (_places.ITEM, "item 'params' (pytree) of step 2 ({p})"),
    "run/2/extras": (_places.JSON_ITEM, "item 'extras' (json) of step 2 ({p})"),
    "orbax": (_places.ORBAX, "an Orbax checkpoint at {p}"),
    "state.msgpack": (_places.MSGPACK, "a Flax msgpack checkpoint at {p}"),
    "staged": (_places.UNFINISHED, "{p}, whose save was interrupted or is still running"),
    "empty": (_places.NOTHING, "no checkpoint at {p}"),
    "missing": (_places.NOTHING, "no checkpoint at {p}"),
}


@pytest.mark.parametrize("name", list(KINDS))
def test_each_place_is_classified_once_with_its_description(world, name):
    loc = Location.from_path(world / name)
    kind, text = KINDS[name]
    place = _places.classify(loc)
    assert place.kind == kind
    assert place.description == text.format(p=loc, r=world)
    with pytest.raises(dataclasses.FrozenInstanceError):
        place.kind = _places.NOTHING  # type: ignore[misc]
    # a reader of a run directory lists first; what it finds is the same kind
    assert _places.classify(loc, steps_first=True).kind == kind


def test_the_item_found_rides_along_and_the_staging_file_is_named(world):
    item = _places.classify(Location.from_path(world / "run" / "2" / "extras")).item
    assert (item.name, item.entry.kind, item.manifest.step) == ("extras", "json", 2)
    assert _places.classify(Location.from_path(world / "staged")).staged == "_METADATA.json"


def test_a_json_item_is_read_without_trying_the_native_reader(world, monkeypatch):
    """The fronts dispatch on the classification: no native read is tried (and failed)
    first for a step's JSON item, and an Orbax place is no native read either."""
    tried = []
    real = _core_restore.restore_with

    def counting(*args, **kwargs):
        tried.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(_core_restore, "restore_with", counting)
    monkeypatch.setattr(_core_restore, "metadata", lambda *a: tried.append(a) or 1 / 0)
    assert fop.restore(world / "run" / "2" / "extras") == {"loss": 0.5}
    assert fop.metadata(world / "run" / "2" / "extras").kind == "json"
    with pytest.raises(fop.CheckpointNotFoundError, match="is an Orbax checkpoint"):
        fop.metadata(world / "orbax")
    assert tried == []
    np.testing.assert_array_equal(fop.restore(world / "ckpt")["w"], np.arange(3.0))
    assert len(tried) == 1


def test_every_front_words_a_wrong_place_from_the_one_classification(world):
    step = world / "run" / "2"
    with pytest.raises(fop.CheckpointError, match="is a step of a checkpoint directory"):
        fop.restore(step)
    with pytest.raises(fop.CheckpointNotFoundError, match="is a run directory of Checkpoint"):
        fop.metadata(world / "run")
    with pytest.raises(fop.NotCommittedError, match="its save was interrupted"):
        fop.restore(world / "staged")
    with pytest.raises(fop.CheckpointNotFoundError, match=r"is step 2 of the run directory"):
        fop.restore_params(step)
    with pytest.raises(fop.CheckpointNotFoundError, match="is a checkpoint of one pytree"):
        fop.restore_params(world / "ckpt")
    with pytest.raises(fop.CheckpointNotFoundError, match="Flax msgpack checkpoint"):
        fop.verify(world / "state.msgpack")
    results = fop.verify(step / "extras")
    assert [(r.item, r.ok) for r in results] == [("extras", True)]
