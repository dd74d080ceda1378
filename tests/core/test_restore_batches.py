"""Restoring part of a batch of small leaves from local files (version 1's chunk files,
version 2's data files): only the inner chunks under the leaves asked for are read, and
damage there still names the leaf; small leaves placed on one device keep their values
and the sharding asked for."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import CorruptCheckpointError
from flax_orbax_plugin._format import records as _records
from flax_orbax_plugin._zarr import arrays as _arrays
from flax_orbax_plugin._zarr import chunk_files as _chunk_files

INNER = 4 << 10  # bytes per inner chunk; files of 16 of them


def _tree():
    rng = np.random.default_rng(3)
    leaf = lambda: rng.standard_normal(256, dtype=np.float32)  # 1 KiB
    return {"a": [leaf() for _ in range(300)], "params": [leaf() for _ in range(60)]}


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def saved(tmp_path, monkeypatch, request):
    """A batch of 360 leaves in ~6 files (shards) of 64 KiB (the sizes scaled down 256x),
    in format version 1 (chunk files) and 2 (segments of one data file)."""
    monkeypatch.setattr(_arrays, "BATCH_CHUNK_BYTES", 16 * INNER)
    monkeypatch.setattr(_records, "BATCH_INNER_CHUNK_BYTES", INNER)
    tree = _tree()
    fop.save(tmp_path / "c", tree, format_version=request.param)
    return tmp_path / "c", tree


def _shard_file(root, batch: str, file: int):
    """(the file holding shard ``file`` of ``batch``, the shard's offset in it)."""
    if (root / "b").exists():  # version 1: a chunk file per shard
        return root / "b" / batch / "c" / str(file), 0
    index = json.loads((root / "data" / "0.json").read_text())
    number, offset, _, _ = index["chunks"][f"b/{batch}/c/{file}"]
    return root / "data" / index["files"][number]["name"], offset


def _flip_byte_of(root, index: int) -> str:
    """Flips a byte inside the stored data of leaf ``params/<index>``; its path."""
    doc = json.loads((root / "_METADATA.json").read_text())
    path = f"params/{index}"
    storage = next(r for r in doc["leaves"] if r["path"] == path)["storage"]
    batch = doc["batches"][storage["batch"]]
    off = storage["offset"] + 3  # elements
    inner = INNER // 4
    file, at = divmod(off, batch["chunk"])
    position = (at // inner) * (INNER + 4) + (at % inner) * 4
    name, base = _shard_file(root, storage["batch"], file)
    data = bytearray(name.read_bytes())
    data[base + position] ^= 0x10
    name.write_bytes(bytes(data))
    return path


def test_part_of_a_batch_reads_about_its_own_bytes(saved):
    root, tree = saved
    before = _chunk_files.bytes_read()
    out = fop.restore(root, {"params": tree["params"]}, partial=True)
    read = _chunk_files.bytes_read() - before
    wanted = sum(x.nbytes for x in tree["params"])
    # the leaves' inner chunks (one more at each end at most) and two files' indexes
    assert wanted <= read <= wanted + 2 * (INNER + 4) + 2 * (16 * 16 + 4), (read, wanted)
    for got, value in zip(out["params"], tree["params"], strict=True):
        np.testing.assert_array_equal(got, value)
    whole = fop.restore(root, tree)  # the whole batch, file by file
    for got, value in zip(whole["a"] + whole["params"], tree["a"] + tree["params"], strict=True):
        np.testing.assert_array_equal(got, value)


def test_damage_under_the_leaves_asked_for_names_the_leaf_and_only_there(saved):
    root, tree = saved
    damaged = _flip_byte_of(root, 37)
    with pytest.raises(CorruptCheckpointError, match=f"'{damaged}'") as info:
        fop.restore(root, {"params": tree["params"]}, partial=True)
    assert "'params/5'" not in str(info.value)  # in another inner chunk: not named
    with pytest.raises(CorruptCheckpointError, match=f"'{damaged}'"):
        fop.restore(root, tree)
    out = fop.restore(root, {"a": tree["a"]}, partial=True)  # reads no damaged chunk
    np.testing.assert_array_equal(out["a"][299], tree["a"][299])


def test_small_leaves_placed_on_one_device_keep_values_and_sharding(saved):
    root, tree = saved
    device = jax.devices()[-1]
    one = jax.sharding.SingleDeviceSharding(device)
    like = {
        "a": [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one) for x in tree["a"]],
        "params": [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in tree["params"]],
    }
    out = fop.restore(root, like)
    for got, value in zip(out["a"], tree["a"], strict=True):
        assert isinstance(got, jax.Array) and got.sharding == one and got.committed
        np.testing.assert_array_equal(np.asarray(got), value)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # no sharding in like
    for got, value in zip(out["params"], tree["params"], strict=True):
        assert got.sharding == default and got.shape == value.shape
        np.testing.assert_array_equal(np.asarray(got), value)


def test_a_dtype_jax_changes_is_placed_as_jax_device_put_places_it(tmp_path):
    tree = {"f64": np.arange(5, dtype=np.float64), "f32": np.ones((2, 3), np.float32)}
    fop.save(tmp_path / "c", tree, format_version=2)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}
    out = fop.restore(tmp_path / "c", like)
    for k, value in tree.items():
        assert out[k].dtype == jax.device_put(value).dtype  # float64: float32 without x64
        np.testing.assert_array_equal(np.asarray(out[k]), value.astype(out[k].dtype))
