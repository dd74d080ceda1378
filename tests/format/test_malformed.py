"""Malformed native metadata, checksum-valid (resealed) or not, and environmental errors
during a read.

Every malformed ``_METADATA.json`` ends in a CorruptCheckpointError naming the file and
the field (never RecursionError, OverflowError, MemoryError, TypeError or a bare
ValueError); a claimed size is checked against the chunk files on disk before anything
sized by it is allocated, so a CheckpointManager falls back to the older step; an
environmental error (EMFILE, EIO: OSError) is never taken for damage, so no intact
step is set aside.
"""

from __future__ import annotations

import copy
import errno
import json
import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import tree as _tree
from flax_orbax_plugin._base.tree import path_string
from flax_orbax_plugin._core import restore as _restore
from flax_orbax_plugin._errors import CheckpointError, CorruptCheckpointError
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._storage.location import Location
from flax_orbax_plugin._zarr import arrays as _arrays

TREE = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": {"c": np.arange(5, dtype=np.int32), "d": None, "e": 3, "f": 2.5, "g": True},
    "big": np.arange(300_000, dtype=np.float32).reshape(600, 500),
    "seq": [np.int16(7), np.zeros((2, 0), np.float64)],
}
META = _layout.METADATA_FILE


def _reseal(path: str, raw: bytes) -> None:
    """Writes ``raw`` as _METADATA.json and records its sha256 in the commit marker (a
    crafted checkpoint: only validation can catch it)."""
    with open(os.path.join(path, META), "wb") as f:
        f.write(raw)
    marker = os.path.join(path, _layout.COMMIT_FILE)
    if not os.path.exists(marker):  # an item of a manager step: its manifest seals it
        return
    with open(marker, "rb") as f:
        body = json.loads(f.read())
    body.pop("checksum")
    body["files"][META] = _layout.sha256(raw)
    with open(marker, "wb") as f:
        f.write(_layout.seal(body))


def _doc(path: str) -> dict:
    with open(os.path.join(path, META), "rb") as f:
        return json.loads(f.read())


def _leaf(doc: dict, path: str) -> dict:
    return next(r for r in doc["leaves"] if r["path"] == path)


def _same(a, b) -> None:
    assert type(a) is type(b) or isinstance(a, np.ndarray), (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
        assert a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("m") / "c")
    fop.save(path, TREE)
    files = {name: open(os.path.join(path, name), "rb").read() for name in (META, "_COMMITTED")}
    return path, files


def _restore_files(path: str, files: dict) -> None:
    for name, raw in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(raw)


def _deep(n: int):
    x: list = []
    for _ in range(n):
        x = [x]
    return x


def _set_keys(doc, path, keys, new_path):
    rec = _leaf(doc, path)
    rec["keys"], rec["path"] = keys, new_path


CASES = {
    # (mutation of the parsed document, or raw bytes), text the error must contain
    "nesting 100000 deep": (b"[" * 100_000, "nested 100000 levels deep"),
    "nesting in sharding": (
        lambda d: _leaf(d, "big").__setitem__("sharding", {"x": _deep(500)}),
        "nested 505 levels deep",
    ),
    "nesting in sharding, within the document's depth": (
        lambda d: _leaf(d, "big").__setitem__("sharding", {"x": _deep(20)}),
        "sharding",
    ),
    "a time past year 9999": (lambda d: d.__setitem__("created_at", 1e300), "created_at"),
    "shape overflowing int64": (
        lambda d: (
            _leaf(d, "big").__setitem__("shape", [2**40] * 4),
            _leaf(d, "big")["storage"].__setitem__("chunk_shape", [1] * 4),
        ),
        "shape",
    ),
    "chunk shape product overflowing int64": (
        lambda d: (
            _leaf(d, "big").__setitem__("shape", [2**31, 2**31]),
            _leaf(d, "big")["storage"].__setitem__("chunk_shape", [2**31, 2**31]),
        ),
        "shape",
    ),
    "dict keys of mixed types": (
        lambda d: _set_keys(d, "b/c", [["dict", "b"], ["dict", 1]], "b/1"),
        "keys",
    ),
    "list and dict entries in one node": (
        lambda d: _set_keys(d, "a", [["seq", 0]], "0"),
        "keys",
    ),
    "a leaf under a leaf": (
        lambda d: _set_keys(d, "b/c", [["dict", "a"], ["dict", "c"]], "a/c"),
        "keys",
    ),
    "bool as a dimension": (lambda d: _leaf(d, "a").__setitem__("shape", [True, 4]), "shape"),
    "float as an offset": (
        lambda d: _leaf(d, "a")["storage"].__setitem__("offset", 0.0),
        "storage.offset",
    ),
    "number overflowing to infinity": (
        lambda d: d.__setitem__("created_at", "INF"),
        "created_at",
    ),
    "a Python int with a shape": (
        lambda d: (
            _leaf(d, "b/e").__setitem__("shape", [1]),
            _leaf(d, "b/e")["storage"].__setitem__("size", 1),
        ),
        "shape",
    ),
    "a Python float of complex dtype": (
        lambda d: _leaf(d, "b/f").__setitem__("dtype", "complex128"),
        "dtype",
    ),
    "jax_version not a string": (lambda d: d.__setitem__("jax_version", _deep(50)), "jax_version"),
    "batch index larger than its files": (
        lambda d: [b.__setitem__("chunk", 2**40) for b in d["batches"].values()],
        "batches",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_metadata_names_the_file_and_the_field(saved, case):
    path, files = saved
    mutation, field = CASES[case]
    if isinstance(mutation, bytes):
        raw = mutation
    else:
        doc = _doc(path)
        mutation(doc)
        raw = json.dumps(doc).encode()
        if b'"INF"' in raw:  # a number JSON parses to infinity
            raw = raw.replace(b'"INF"', b"1e999")
    try:
        _reseal(path, raw)
        for call in (fop.restore, fop.metadata):
            if call is fop.metadata and field == "batches":
                continue  # metadata reads no batch file: the claim is checked on read
            with pytest.raises(CorruptCheckpointError) as info:
                call(path)
            assert META in str(info.value) and field in str(info.value), str(info.value)
        (result,) = fop.verify(path)
        assert not result.ok and META in result.error and field in result.error
    finally:
        _restore_files(path, files)
    _same(TREE, fop.restore(path))


def _claim_huge_shape(path: str, leaf: str = "big", shape=(2**22, 2**22)) -> None:
    """Reseals ``path``'s metadata with a 64 TiB claim for ``leaf``; its zarr.json (not
    checksummed) is changed to agree, so only a check against the files on disk finds
    it (before the fix: an allocation of the claimed size, a bare MemoryError)."""
    doc = _doc(path)
    index = next(i for i, r in enumerate(doc["leaves"]) if r["path"] == leaf)
    rec = doc["leaves"][index]
    rec["shape"] = list(shape)
    rec["storage"]["chunk_shape"] = list(shape)
    _reseal(path, json.dumps(doc).encode())
    zarr_json = os.path.join(path, "d", str(index), "zarr.json")
    with open(zarr_json) as f:
        z = json.load(f)
    z["shape"] = list(shape)
    z["chunk_grid"]["configuration"]["chunk_shape"] = list(shape)
    with open(zarr_json, "w") as f:
        json.dump(z, f)


def test_a_resealed_size_claim_is_checked_against_the_files_before_allocating(tmp_path):
    path = str(tmp_path / "c")
    fop.save(path, TREE, format_version=1)  # version 1: the claim is checked per chunk file
    _claim_huge_shape(path)
    pattern = r"_METADATA.json: field leaves\[\d+\] \('big'\).shape: .*found 1 files of"
    with pytest.raises(CorruptCheckpointError, match=pattern):
        fop.restore(path)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        like = {"big": jax.ShapeDtypeStruct((2**22, 2**22), np.float32)}
        fop.restore(path, like, partial=True)
    (result,) = fop.verify(path)
    assert not result.ok and "('big').shape" in result.error


def test_manager_falls_back_from_a_latest_step_with_a_huge_claim(tmp_path, caplog):
    d = tmp_path / "run"
    older = {"big": np.arange(300_000, dtype=np.float32).reshape(600, 500), "n": 1}
    with fop.CheckpointManager(d, format_version=1) as mngr:  # edits d/<i>/zarr.json
        mngr.save(1, {"params": older})
        mngr.save(2, {"params": {"big": older["big"] + 1, "n": 2}})
    item = str(d / "2" / "params")
    _claim_huge_shape(item)
    manifest = d / "2" / _layout.MANIFEST_FILE  # the step manifest seals the metadata
    body = json.loads(manifest.read_bytes())
    body.pop("checksum")
    body["files"][f"params/{META}"] = _layout.sha256(open(os.path.join(item, META), "rb").read())
    manifest.write_bytes(_layout.seal(body))
    with caplog.at_level("WARNING", logger="flax_orbax_plugin"):
        with fop.CheckpointManager(d) as mngr:
            out = mngr.restore()
            assert mngr.restored_step == 1
    _same(older, out["params"])
    assert any("skipping damaged step 2" in r.getMessage() for r in caplog.records)
    assert any("('big').shape" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("version", [1, 2])
def test_an_injected_os_error_during_a_chunk_read_is_not_damage(tmp_path, monkeypatch, version):
    """An OSError while reading a chunk (a chunk file, or a data file of version 2: the
    direct reader's storage layer) raises as an OSError; the manager sets no intact
    step aside and names none damaged."""
    d = tmp_path / "run"
    big = np.arange(300_000, dtype=np.float32).reshape(600, 500)
    with fop.CheckpointManager(d, format_version=version) as mngr:
        mngr.save(1, {"params": {"big": big}})
        mngr.save(2, {"params": {"big": big + 1}})
    before = sorted(os.listdir(d))
    monkeypatch.setenv("FOP_FAIL_AT", "read_chunk")
    with fop.CheckpointManager(d) as mngr:
        with pytest.raises(OSError) as info:
            mngr.restore()
    assert not isinstance(info.value, CheckpointError)
    with pytest.raises(OSError) as info:
        fop.verify(d)
    assert not isinstance(info.value, CheckpointError)
    assert sorted(os.listdir(d)) == before  # nothing set aside
    monkeypatch.delenv("FOP_FAIL_AT")
    with fop.CheckpointManager(d, read_only=True) as mngr:
        np.testing.assert_array_equal(mngr.restore()["params"]["big"], big + 1)
    assert all(r.ok for r in fop.verify(d, all_steps=True))


def test_tensorstore_errors_are_classified_from_real_failures(tmp_path):
    """A real EMFILE inside tensorstore is the environment's (an OSError with errno
    EMFILE); a real checksum mismatch and a real missing chunk are damage."""
    path = tmp_path / "c"
    fop.save(
        path, {"w": np.arange(1_000_000, dtype=np.float32)}, compression="zstd", format_version=1
    )
    loc = Location.from_path(path)  # version 1: leaf 0 is the zarr3 array d/0
    record = _restore.read_document(loc).leaves[0]
    store = _arrays.open_for_read(_arrays.leaf_spec(loc, 0, record)).result()
    fds = []
    try:
        while True:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as e:
        assert e.errno == errno.EMFILE
    try:
        with pytest.raises(ValueError) as info:
            store.read().result()
    finally:
        for fd in fds:
            os.close(fd)
    env = _arrays.environmental(info.value)
    assert isinstance(env, OSError) and env.errno == errno.EMFILE, info.value
    (chunk,) = [os.path.join(r, f) for r, _, fs in os.walk(path / "d" / "0" / "c") for f in fs]
    raw = bytearray(open(chunk, "rb").read())
    raw[len(raw) // 2] ^= 1
    open(chunk, "wb").write(bytes(raw))
    with pytest.raises(ValueError) as info:
        store.read().result()
    assert _arrays.environmental(info.value) is None, info.value
    os.remove(chunk)
    with pytest.raises(ValueError) as info:
        store.read().result()
    assert _arrays.environmental(info.value) is None, info.value


# -- every field mutated, resealed: the saved values or a CheckpointError ----------------

_NASTY = st.sampled_from(
    [
        None,
        True,
        False,
        0,
        -1,
        1,
        2,
        7,
        2**31,
        2**53 + 1,
        2**63,
        2**64 + 5,
        10**30,
        0.5,
        -0.0,
        1e308,
        "",
        "x",
        "../x",
        "float32",
        "uint8",
        "complex64",
        "zstd:3",
        "array",
        "batch",
        "py_int",
        "prng_key",
        [],
        {},
        [0],
        [1, 1],
        [2**40, 2**40],
        [True],
        ["dict", 1],
        ["seq", 0],
        {"type": "array", "chunk_shape": [1]},
        "DEEP",
    ]
)


_SAVED = {p: v for p, _, v in _tree.flatten(TREE)[0]}


def _data_fields(record) -> dict:
    return {k: v for k, v in record.items() if k not in ("path", "keys")}


def _same_where_unchanged(doc0: dict, doc: dict, out) -> None:
    """A resealed document is trusted as it stands: a leaf moved in the tree (its keys
    and path changed together) is restored where the document puts it. Every leaf whose
    data fields (kind, shape, dtype, storage) are as saved must hold the saved value,
    and the result holds exactly the document's leaves."""
    restored = {p: v for p, _, v in _tree.flatten(out)[0]}
    listed = {r["path"] for r in doc["leaves"]}
    assert listed <= set(restored)
    # a list index no leaf names is None (checkpoints written before empty nodes were
    # recorded leave such holes)
    assert all(restored[p] is None for p in set(restored) - listed)
    for old, new in zip(doc0["leaves"], doc["leaves"], strict=True):
        if _data_fields(old) == _data_fields(new) and doc["batches"] == doc0["batches"]:
            _same(_SAVED[old["path"]], restored[new["path"]])


_KEYS = st.sampled_from(
    [["seq", 0], ["seq", 1], ["seq", 3], ["flat", 0], ["dict", 0], ["dict", 1]]
    + [["dict", "a"], ["dict", "b"], ["dict", "c"], ["attr", "a"], ["dict", "x"]]
)


def _places(obj) -> list[tuple]:
    """Every (container, key) of a JSON value, depth first."""
    out, stack = [], [obj]
    while stack:
        x = stack.pop()
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            out.append((x, k))
            stack.append(v)
    return out


@settings(
    max_examples=200, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
)
@given(data=st.data(), count=st.integers(1, 3))
def test_every_field_mutated_and_resealed_restores_exactly_or_raises(saved, data, count):
    path, files = saved
    doc0 = json.loads(files[META])
    doc = copy.deepcopy(doc0)
    for _ in range(count):
        places = _places(doc)
        if data.draw(st.booleans()):  # most fields are in the leaf and batch records
            within = [doc.get("leaves"), doc.get("batches")]
            places = [
                p for w in within if isinstance(w, (dict, list)) for p in _places(w)
            ] or places
        parent, key = data.draw(st.sampled_from(places))
        action = data.draw(
            st.sampled_from(["replace", "delete", "wrap", "add", "transplant", "rekey", "rekey"])
        )
        value = copy.deepcopy(data.draw(_NASTY))  # the constants are shared
        value = _deep(3000) if value == "DEEP" else value
        if action == "rekey" and isinstance(doc.get("leaves"), list) and doc["leaves"]:
            # a leaf moved in the tree, its path made to agree: only the tree's shape,
            # not the path check, can refuse it
            leaf = data.draw(st.sampled_from(doc["leaves"]))
            if isinstance(leaf, dict) and isinstance(leaf.get("keys"), list):
                keys = leaf["keys"][: data.draw(st.integers(0, 2))]
                keys = keys + data.draw(st.lists(_KEYS, min_size=0, max_size=2))
                leaf["keys"] = copy.deepcopy(keys)
                if all(isinstance(k, list) and len(k) == 2 for k in keys):
                    leaf["path"] = path_string([tuple(k) for k in keys])
        elif action == "transplant":  # a plausible value: another field's, from anywhere
            source, at = data.draw(st.sampled_from(places))
            parent[key] = copy.deepcopy(source[at])
        elif action == "delete":
            del parent[key]
        elif action == "wrap":
            parent[key] = [parent[key]]
        elif action == "add" and isinstance(parent, dict):
            parent[data.draw(st.sampled_from(["extra", "codec", "impl", "digest", "size"]))] = value
        else:
            parent[key] = value
    try:
        raw = json.dumps(doc).encode()
    except RecursionError:
        raw = b"[" * 100_000
    try:
        _reseal(path, raw)
        try:
            out = fop.restore(path)
        except CheckpointError:
            out = None
        else:
            _same_where_unchanged(doc0, doc, out)
        try:
            info = fop.metadata(path)
        except CheckpointError:
            assert out is None, "metadata refused what restore read"
        else:
            if out is not None:  # the leaves restore returned, as metadata lists them
                assert set(info.leaves) <= {p for p, _, _ in _tree.flatten(out)[0]}
        (result,) = fop.verify(path)
        assert result.ok == (out is not None), result.error
    finally:
        _restore_files(path, files)
