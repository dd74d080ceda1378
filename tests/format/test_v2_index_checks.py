"""A version-2 data index that lists one chunk's bytes for another is damage.

The index is crafted and resealed (its sha256 recorded in the commit record again), so
only the index checker can catch it: overlapping segments (two keys sharing bytes,
each passing its crc32c) or a key listed twice. Restore, ``verify`` and the next
incremental step (which must not reuse the data files it lists) all see it, on a core
checkpoint, on a manager step and on a persistent tier's copy (S3 server)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format import layout as _layout

pytest_plugins = ["_servers"]

N = 300_000  # float32: 1.2 MB, one chunk of its own (not batched)


def _tree():
    return {"a": np.arange(N, dtype=np.float32), "b": np.ones(N, np.float32)}


def _reseal_index(path: str, raw: bytes) -> None:
    """Writes ``raw`` as ``data/0.json`` of the checkpoint (or step item) at ``path``
    and records its sha256 in the commit marker, or in the step's manifest."""
    with open(os.path.join(path, "data", "0.json"), "wb") as f:
        f.write(raw)
    marker = os.path.join(path, _layout.COMMIT_FILE)
    if os.path.exists(marker):
        key, record = "data/0.json", marker
    else:
        key = f"{os.path.basename(path)}/data/0.json"
        record = os.path.join(os.path.dirname(path), _layout.MANIFEST_FILE)
    with open(record, "rb") as f:
        body = json.loads(f.read())
    body.pop("checksum")
    body["files"][key] = _layout.sha256(raw)
    with open(record, "wb") as f:
        f.write(_layout.seal(body))


def _index(path: str) -> dict:
    with open(os.path.join(path, "data", "0.json"), "rb") as f:
        return json.loads(f.read())


def _overlapping(path: str) -> bytes:
    """The index with leaf 1's chunk pointing at leaf 0's bytes."""
    doc = _index(path)
    doc["chunks"]["d/1/c/0"] = list(doc["chunks"]["d/0/c/0"])
    return json.dumps(doc).encode()


def _listed_twice(path: str) -> bytes:
    """The index with leaf 1's key listed twice (its own segment, both times)."""
    doc = _index(path)
    text = json.dumps(doc)
    entry = json.dumps({"d/1/c/0": doc["chunks"]["d/1/c/0"]})[1:-1]
    return text.replace('"chunks": {', '"chunks": {' + entry + ", ", 1).encode()


@pytest.mark.parametrize(
    "craft, message",
    [
        (_overlapping, r"data/0.json: field chunks: segments of 'd/0/c/0'.*'d/1/c/0'.*overlap"),
        (_listed_twice, r"data/0.json: field 'd/1/c/0': expected once in its object"),
    ],
)
def test_a_resealed_index_sharing_or_repeating_a_segment_is_damage(tmp_path, craft, message):
    path = str(tmp_path / "ckpt")
    fop.save(path, _tree(), format_version=2)
    _reseal_index(path, craft(path))
    with pytest.raises(fop.CorruptCheckpointError, match=message):
        fop.restore(path)
    (result,) = fop.verify(path)
    assert not result.ok
    assert "data/0.json" in result.error


@pytest.mark.parametrize("craft", [_overlapping, _listed_twice])
def test_a_manager_step_with_such_an_index_is_damage_and_never_reused(tmp_path, caplog, craft):
    d = str(tmp_path / "run")
    with fop.CheckpointManager(d, format_version=2, incremental=True, keep=5) as mngr:
        mngr.save(1, {"params": _tree()})
        mngr.wait()
        item = os.path.join(d, "1", "params")
        _reseal_index(item, craft(item))
        assert not all(r.ok for r in fop.verify(d, step=1))
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            mngr.save(2, {"params": _tree()})  # unchanged leaves: would reuse step 1's file
            mngr.wait()
    assert "not reusing data files" in caplog.text
    assert not os.path.samefile(
        os.path.join(d, "1", "params", "data", "0-0.bin"),
        os.path.join(d, "2", "params", "data", "0-0.bin"),
    )
    with fop.CheckpointManager(d, read_only=True) as mngr:
        got = mngr.restore(step=2)
        np.testing.assert_array_equal(got["params"]["b"], _tree()["b"])
        with pytest.raises(fop.CorruptCheckpointError, match="data/0.json"):
            mngr.restore(step=1)
    assert all(r.ok for r in fop.verify(d, step=2))


def test_a_persistent_copy_with_such_an_index_is_never_copied_down(s3_location, tmp_path):
    """The tier's copy-down verifies with the same index checker: the bucket's step 2,
    its index resealed to overlap, is refused and step 1 restored instead."""
    with fop.CheckpointManager(tmp_path / "a", persistent=s3_location.url, format_version=2) as m:
        for step in (1, 2):
            m.save(step, {"params": {k: v + step for k, v in _tree().items()}})
            m.wait()
        assert m.persistent.wait(60)
    kv = s3_location.kvstore()
    doc = json.loads(bytes(kv.read("2/params/data/0.json").result().value))
    doc["chunks"]["d/1/c/0"] = list(doc["chunks"]["d/0/c/0"])
    raw = json.dumps(doc).encode()
    manifest = json.loads(bytes(kv.read(f"2/{_layout.MANIFEST_FILE}").result().value))
    manifest.pop("checksum")
    manifest["files"]["params/data/0.json"] = _layout.sha256(raw)
    kv.write("2/params/data/0.json", raw).result()
    kv.write(f"2/{_layout.MANIFEST_FILE}", _layout.seal(manifest)).result()
    with fop.CheckpointManager(tmp_path / "b", persistent=s3_location.url) as m:
        restored = m.restore()
        assert m.restored_step == 1
        np.testing.assert_array_equal(restored["params"]["b"], _tree()["b"] + 1)


def _reseal_metadata(path: str, doc: dict) -> None:
    raw = json.dumps(doc).encode()
    with open(os.path.join(path, _layout.METADATA_FILE), "wb") as f:
        f.write(raw)
    marker = os.path.join(path, _layout.COMMIT_FILE)
    with open(marker, "rb") as f:
        body = json.loads(f.read())
    body.pop("checksum")
    body["files"][_layout.METADATA_FILE] = _layout.sha256(raw)
    with open(marker, "wb") as f:
        f.write(_layout.seal(body))


@pytest.mark.parametrize("where", ["leaf", "batch"])
def test_a_resealed_metadata_dtype_is_checked_against_the_index(tmp_path, where):
    """Version 2 has no zarr.json: the data index records each array's stored dtype, so
    a metadata document resealed with another dtype of the same size (float32 ->
    int32: the bytes would be reinterpreted, every crc32c still passing) is damage on
    restore and verify, as version 1's zarr.json makes it."""
    path = str(tmp_path / "ckpt")
    tree = {"a": np.arange(N, dtype=np.float32), "s": np.ones(3, np.float32)}
    fop.save(path, tree, format_version=2)
    with open(os.path.join(path, _layout.METADATA_FILE), "rb") as f:
        doc = json.loads(f.read())
    if where == "leaf":
        doc["leaves"][0]["dtype"] = "int32"
        message = r"leaves\[0\] \('a'\)\.dtype: the metadata claims 'int32'.*'float32'"
    else:  # a batch's name carries its dtype: renamed with it, its chunks are missing
        doc["batches"] = {"0.int32": dict(doc["batches"]["0.float32"], dtype="int32")}
        doc["leaves"][1]["dtype"] = "int32"
        doc["leaves"][1]["storage"]["batch"] = "0.int32"
        message = r"batches\['0\.int32'\]"
    _reseal_metadata(path, doc)
    with pytest.raises(fop.CorruptCheckpointError, match=message):
        fop.restore(path)
    assert not any(r.ok for r in fop.verify(path))


def test_an_index_without_dtypes_is_still_read(tmp_path):
    """Indexes written before dtypes were recorded (no ``arrays`` field) restore as
    saved; an ``arrays`` entry for an array the index holds no chunk of is damage."""
    path = str(tmp_path / "ckpt")
    fop.save(path, _tree(), format_version=2)
    doc = _index(path)
    doc.pop("arrays")
    _reseal_index(path, json.dumps(doc).encode())
    np.testing.assert_array_equal(fop.restore(path)["a"], _tree()["a"])
    doc["arrays"] = {"d/7": "float32"}
    _reseal_index(path, json.dumps(doc).encode())
    with pytest.raises(fop.CorruptCheckpointError, match=r"field arrays: expected keys"):
        fop.restore(path)
