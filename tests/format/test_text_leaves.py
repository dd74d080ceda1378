"""str and bytes leaves in pytrees (issue 25): JSON in the metadata, bounded, restored
with their type."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format import layout as _layout


def tree():
    return {"name": "adamw é", "tokenizer": b"\x00\xffspm", "w": np.arange(3.0), "empty": ""}


def test_round_trip_with_and_without_like(tmp_path):
    fop.save(tmp_path / "c", tree())
    for like in (None, {"name": "", "tokenizer": b"", "w": np.zeros(3), "empty": "x"}):
        out = fop.restore(tmp_path / "c", like)
        assert out["name"] == "adamw é" and type(out["name"]) is str
        assert out["tokenizer"] == b"\x00\xffspm" and type(out["tokenizer"]) is bytes
        assert out["empty"] == ""
        np.testing.assert_array_equal(out["w"], np.arange(3.0))
    leaves = fop.metadata(tmp_path / "c").leaves
    assert leaves["name"].kind == "py_str" and leaves["tokenizer"].kind == "py_bytes"
    assert leaves["name"].nbytes == 0  # no array data: the value is in the metadata
    doc = json.loads((tmp_path / "c" / "_METADATA.json").read_text())
    by_path = {r["path"]: r for r in doc["leaves"]}
    assert by_path["tokenizer"]["value"] == "AP9zcG0="  # base64
    assert all(r.ok for r in fop.verify(tmp_path / "c"))


def test_type_mismatch_names_the_leaf(tmp_path):
    fop.save(tmp_path / "c", tree())
    like = {"name": b"", "tokenizer": b"", "w": np.zeros(3), "empty": ""}
    with pytest.raises(fop.StructureError, match=r"leaf 'name': expected bytes .* found a str"):
        fop.restore(tmp_path / "c", like)


def test_through_the_manager(tmp_path):
    state = {"params": {"w": np.ones(2)}, "meta": {"arch": "resnet50", "vocab": b"ab"}}
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(1, state)
    with fop.CheckpointManager(tmp_path / "run", read_only=True) as mngr:
        out = mngr.restore(like=state)
    assert out["meta"] == {"arch": "resnet50", "vocab": b"ab"}


def test_size_bounded_at_save_and_read(tmp_path):
    limit = _layout.MAX_TEXT_BYTES
    fop.save(tmp_path / "ok", {"s": "x" * limit})
    with pytest.raises(fop.StructureError, match=rf"leaf 's': a str of {limit + 1} bytes"):
        fop.save(tmp_path / "big", {"s": "x" * (limit + 1)})
    with pytest.raises(fop.StructureError, match="leaf 'b': a bytes of"):
        fop.save(tmp_path / "big", {"b": bytes(limit + 1)})
    assert not (tmp_path / "big").exists()


@pytest.mark.parametrize(
    "record, field",
    [
        ({"kind": "py_str", "value": 3}, "value"),
        ({"kind": "py_str"}, "value"),
        ({"kind": "py_str", "value": "é" * (_layout.MAX_TEXT_BYTES // 2 + 1)}, "value"),
        ({"kind": "py_bytes", "value": "not base64!"}, "value"),
        ({"kind": "py_bytes", "value": "A" * (2 * _layout.MAX_TEXT_BYTES + 1)}, "value"),
    ],
)
def test_malformed_record_is_named(record, field):
    obj = {"path": "s", "keys": [["dict", "s"]], **record}
    with pytest.raises(fop.CorruptCheckpointError, match=rf"leaves\[0\] \('s'\)\.{field}"):
        _layout.leaf_from_json(obj, "m.json", 0)
