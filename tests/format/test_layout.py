"""The on-disk layout: typed records validate every field; everything restore trusts is
checksummed; crafted and damaged metadata ends in a CheckpointError, never a wrong value."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import CheckpointError, CorruptCheckpointError
from flax_orbax_plugin._format import layout as _layout

TREE = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": {"c": np.arange(5, dtype=np.int32), "d": None, "e": 3, "f": 2.5},
    "big": np.arange(300_000, dtype=np.float32).reshape(600, 500),
}


def _assert_same(a, b):
    assert type(a) is type(b) or isinstance(a, np.ndarray)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    else:
        assert a == b


def _reseal(path: str, doc: dict) -> None:
    """Rewrites _METADATA.json and the checksum the marker records for it: a crafted
    checkpoint whose checksums are consistent, so only validation can catch it."""
    raw = json.dumps(doc).encode()
    with open(os.path.join(path, _layout.METADATA_FILE), "wb") as f:
        f.write(raw)
    marker = os.path.join(path, _layout.COMMIT_FILE)
    body = json.loads(open(marker, "rb").read())
    body.pop("checksum")
    body["files"][_layout.METADATA_FILE] = _layout.sha256(raw)
    with open(marker, "wb") as f:
        f.write(_layout.seal(body))


def _doc(path: str) -> dict:
    return json.loads(open(os.path.join(path, _layout.METADATA_FILE), "rb").read())


def test_one_byte_changed_in_metadata_is_an_error_naming_the_file(tmp_path):
    path = str(tmp_path / "c")
    fop.save(path, TREE)
    meta = os.path.join(path, _layout.METADATA_FILE)
    raw = bytearray(open(meta, "rb").read())
    i = raw.index(b'"offset":') + len(b'"offset":')
    raw[i] = ord("1") if raw[i] != ord("1") else ord("2")
    open(meta, "wb").write(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="_METADATA.json: checksum mismatch"):
        fop.restore(path)
    assert not fop.verify(path)[0].ok


def test_resealed_dtype_change_is_caught_by_zarr_json(tmp_path):
    path = str(tmp_path / "c")
    fop.save(path, TREE, format_version=1)  # version 1: each array has a zarr.json
    doc = _doc(path)
    big = next(r for r in doc["leaves"] if r["path"] == "big")
    big["dtype"] = "uint32"
    _reseal(path, doc)
    with pytest.raises(CorruptCheckpointError, match="'big'.*data_type"):
        fop.restore(path)
    like = dict(TREE)
    with pytest.raises(CheckpointError):
        fop.restore(path, like)


def test_resealed_batch_offset_out_of_range_names_the_field(tmp_path):
    path = str(tmp_path / "c")
    fop.save(path, TREE)
    doc = _doc(path)
    rec = next(r for r in doc["leaves"] if r["path"] == "b/c")
    rec["storage"]["offset"] = 10**9
    _reseal(path, doc)
    with pytest.raises(CorruptCheckpointError, match=r"storage.offset"):
        fop.restore(path)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["leaves"][0].__setitem__("shape", [10**30]), "shape"),
        (lambda d: d["leaves"][0].__setitem__("keys", []), "keys"),
        (lambda d: d["leaves"][0].__setitem__("keys", [["seq", 2**40]]), "keys"),
        (lambda d: d["leaves"][0].__setitem__("dtype", "object"), "dtype"),
        (lambda d: d["leaves"][0].__setitem__("kind", "pickle"), "kind"),
        (lambda d: d.__setitem__("leaves", {}), "leaves"),
        (lambda d: d.__setitem__("format_version", 99), "format_version"),
        (lambda d: d.__setitem__("process_count", 0), "process_count"),
        (lambda d: d["leaves"][1].__setitem__("path", "../../etc/passwd"), "path"),
    ],
)
def test_malformed_metadata_is_corrupt_checkpoint_error(tmp_path, mutate, field):
    path = str(tmp_path / "c")
    fop.save(path, TREE)
    doc = _doc(path)
    mutate(doc)
    _reseal(path, doc)
    with pytest.raises(CorruptCheckpointError, match=field):
        fop.restore(path)
    with pytest.raises(CorruptCheckpointError):
        fop.metadata(path)


def test_marker_without_checksum_is_refused(tmp_path):
    path = str(tmp_path / "c")
    fop.save(path, {"x": np.ones(3)})
    open(os.path.join(path, _layout.COMMIT_FILE), "w").write('{"committed_at": 1}')
    with pytest.raises(CorruptCheckpointError, match="without checksums"):
        fop.restore(path)


def test_manifest_json_items_are_checksummed(tmp_path):
    d = tmp_path / "run"
    with fop.CheckpointManager(d) as m:
        m.save(10, {"params": {"w": np.ones(3)}, "step": 10}, extras={"loss": 1.0})
    # A step file truncated from 10 to 1 must not restore step 1.
    (d / "10" / "step" / "value.json").write_text("1")
    with pytest.raises(CorruptCheckpointError, match="step/value.json: checksum mismatch"):
        fop.CheckpointManager(d, read_only=True).restore(step=10, items="step")
    bad = [r for r in fop.verify(d) if not r.ok]
    assert [r.item for r in bad] == ["step"]


def test_manifest_damage_and_crafted_item_names(tmp_path):
    d = tmp_path / "run"
    with fop.CheckpointManager(d) as m:
        m.save(1, {"params": {"w": np.ones(3)}})
    manifest = d / "1" / _layout.MANIFEST_FILE
    body = json.loads(manifest.read_bytes())
    body.pop("checksum")
    body["items"]["params"]["dir"] = "../../outside"
    manifest.write_bytes(_layout.seal(body))
    with pytest.raises(CorruptCheckpointError, match="safe directory name"):
        fop.restore_params(d)
    manifest.write_bytes(manifest.read_bytes().replace(b'"version":1', b'"version":7'))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        fop.restore_params(d)


def test_manifest_bytes_written_and_reused_are_optional_and_validated():
    items = {"params": _layout.ItemEntry("pytree", "params")}
    m = _layout.StepManifest(3, items, {}, bytes_written=10, bytes_reused=20)
    back = _layout.manifest_from_bytes(m.to_bytes(), "m")
    assert (back.bytes_written, back.bytes_reused) == (10, 20)
    plain = _layout.StepManifest(3, items, {})
    assert b'"bytes"' not in plain.to_bytes()  # as written before the field existed
    assert _layout.manifest_from_bytes(plain.to_bytes(), "m").bytes_written is None
    body = json.loads(m.to_bytes())
    body.pop("checksum")
    bads = ({"written": -1, "reused": 0}, {"written": 1}, [1, 2], {"written": "1", "reused": 0})
    for bad in bads:
        with pytest.raises(CorruptCheckpointError, match=r"bytes"):
            _layout.manifest_from_bytes(_layout.seal(dict(body, bytes=bad)), "m")


_MUTATIONS = st.sampled_from(["delete", "type", "negative", "huge", "string", "list"])


def _mutate(obj, choice: str, path_rng: st.DataObject):
    """Applies one mutation at a random place of a JSON value."""
    containers = []

    def walk(x):
        if isinstance(x, dict):
            containers.extend((x, k) for k in x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            containers.extend((x, i) for i in range(len(x)))
            for v in x:
                walk(v)

    walk(obj)
    parent, key = path_rng.draw(st.sampled_from(containers))
    if choice == "delete" and isinstance(parent, dict):
        del parent[key]
    elif choice == "type":
        parent[key] = {"x": 1} if not isinstance(parent[key], dict) else 7
    elif choice == "negative":
        parent[key] = -1
    elif choice == "huge":
        parent[key] = 2**62
    elif choice == "string":
        parent[key] = "../x"
    else:
        parent[key] = [parent[key], parent[key]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    path = str(d / "c")
    fop.save(path, TREE)
    with fop.CheckpointManager(d / "run") as m:
        m.save(3, {"params": TREE, "step": 3}, extras={"loss": 0.5, "tags": ["a"]})
    return d


@settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(choice=_MUTATIONS, reseal=st.booleans(), data=st.data())
def test_fuzzed_metadata_round_trips_or_raises_checkpoint_error(
    saved, tmp_path_factory, choice, reseal, data
):
    src = str(saved / "c")
    path = str(tmp_path_factory.mktemp("t") / "c")
    os.system(f"cp -r {src} {path}")
    doc = _doc(path)
    _mutate(doc, choice, data)
    if reseal:
        _reseal(path, doc)
    else:
        open(os.path.join(path, _layout.METADATA_FILE), "w").write(json.dumps(doc))
    try:
        out = fop.restore(path)
    except CheckpointError:
        return
    _assert_same(TREE, out)


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(choice=_MUTATIONS, target=st.sampled_from(["manifest", "extras"]), data=st.data())
def test_fuzzed_manifest_and_json_items(saved, tmp_path_factory, choice, target, data):
    run = str(tmp_path_factory.mktemp("r") / "run")
    os.system(f"cp -r {saved / 'run'} {run}")
    if target == "manifest":
        f = os.path.join(run, "3", _layout.MANIFEST_FILE)
        body = json.loads(open(f, "rb").read())
        body.pop("checksum")
        _mutate(body, choice, data)
        open(f, "wb").write(_layout.seal(body))
    else:
        f = os.path.join(run, "3", "extras", "value.json")
        value = {"loss": 0.5, "tags": ["a"]}
        _mutate(value, choice, data)
        open(f, "w").write(json.dumps(value))
    mngr = fop.CheckpointManager(run, read_only=True)
    try:
        out = mngr.restore(step=3, items=("params", "extras", "step"))
    except CheckpointError:
        return
    _assert_same(TREE, out["params"])
    assert out["extras"] == {"loss": 0.5, "tags": ["a"]} and out["step"] == 3
