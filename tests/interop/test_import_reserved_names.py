"""An imported tree never lands under an item name this library reserves for another
kind: ``extras`` (JSON: its arrays came back as lists, bf16 included) or
``data_iterator`` (an iterator's state). Such an import is refused before anything
of the step is written, naming the Orbax item (or the state's key) and the reserved
name; the other names keep their trees exactly, and JSON items named so stay JSON."""

from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization

import flax_orbax_plugin as fop


def _orbax_step(path, **args) -> None:
    mngr = ocp.CheckpointManager(path, item_names=tuple(args))
    mngr.save(5, args=ocp.args.Composite(**args))
    mngr.wait_until_finished()
    mngr.close()


_PARAMS = {"w": np.arange(4, dtype=np.float32)}


@pytest.mark.parametrize("name", ["extras", "data_iterator"])
def test_a_pytree_item_with_a_reserved_name_is_refused(tmp_path, name):
    tree = {"big": np.ones((3, 2), np.float32)}
    _orbax_step(
        tmp_path / "run",
        params=ocp.args.StandardSave(_PARAMS),
        **{name: ocp.args.StandardSave(tree)},
        meta=ocp.args.JsonSave({"lr": 0.1}),
    )
    out = tmp_path / "out"
    with pytest.raises(fop.StructureError, match=rf"Orbax item '{name}'.*reserves the item name"):
        fop.import_orbax(tmp_path / "run", out)
    assert not os.path.exists(out / "5")


def test_a_state_key_with_a_reserved_name_is_refused(tmp_path):
    state = {"params": _PARAMS, "extras": {"ema": np.zeros(2, np.float32)}}
    with open(tmp_path / "checkpoint_3", "wb") as f:
        f.write(serialization.msgpack_serialize(state))
    with pytest.raises(fop.StructureError, match=r"key 'extras' of item 'state'.*reserves"):
        fop.import_msgpack(tmp_path / "checkpoint_3", tmp_path / "out")


def test_a_json_item_named_extras_stays_json(tmp_path):
    _orbax_step(
        tmp_path / "run",
        params=ocp.args.StandardSave(_PARAMS),
        extras=ocp.args.JsonSave({"note": "hi"}),
    )
    assert fop.import_orbax(tmp_path / "run", tmp_path / "out") == [5]
    np.testing.assert_array_equal(fop.restore(tmp_path / "out/5/params")["w"], _PARAMS["w"])
    assert fop.restore(tmp_path / "out/5/extras") == {"extras": {"note": "hi"}}
