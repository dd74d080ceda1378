"""Compression in format version 2: zstd segments in the data files, on disk and on S3,
and the compressed golden checkpoint ``v2_zstd_leaf_kinds``.

Each test saves compressible arrays and a batch of small leaves with
``compression="zstd"``, checks the index lists segments shorter than the raw chunks,
restores bit for bit (whole and onto a sharding that reads parts of a leaf), verifies,
then damages one compressed segment and sees restore and ``verify`` name the leaf."""

import json
import os

import golden
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import CorruptCheckpointError

pytest_plugins = ["_servers"]


def _tree():
    rng = np.random.default_rng(0)
    return {
        "w": rng.integers(0, 16, (1024, 1024)).astype(np.float32),  # 4 MiB, compresses
        "e": np.repeat(np.arange(2048, dtype=np.int32)[:, None], 600, 1),  # 4.7 MiB
        "small": {f"l{i}": np.full((i + 1,), i, np.int16) for i in range(20)},
        "s": 3,
    }


def _same(a, b):
    for k, v in a.items():
        if isinstance(v, dict):
            _same(v, b[k])
        else:
            assert np.asarray(b[k]).tobytes() == np.asarray(v).tobytes(), k


def _segments(index: dict, metadata: dict):
    """{leaf path or batch name: [(file, offset, length), ...]}."""
    names = {f"d/{i}/": r["path"] for i, r in enumerate(metadata["leaves"])}
    names.update({f"b/{b}/": b for b in metadata["batches"]})
    out: dict = {}
    for key, (n, offset, length, _) in sorted(index["chunks"].items()):
        prefix = key[: key.index("/c/") + 1]
        out.setdefault(names[prefix], []).append((index["files"][n]["name"], offset, length))
    return out


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


def _check_compressed_then_damage(read, write, url, tree):
    """``read(name)``/``write(name, bytes)``: files of the checkpoint at ``url``."""
    index, meta = json.loads(read("data/0.json")), json.loads(read("_METADATA.json"))
    assert meta["leaves"][0]["storage"]["codec"] == "zstd:3"
    segments = _segments(index, meta)
    raw = {"w": 4 << 20, "e": 2048 * 600 * 4}
    for path in ("w", "e"):
        assert sum(length for _, _, length in segments[path]) < raw[path] // 3, segments[path]
    _same(tree, fop.restore(url))
    assert all(r.ok for r in fop.verify(url))
    # Parts of "e": each of two devices reads the columns it holds.
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    like = {"e": jax.ShapeDtypeStruct((2048, 600), np.int32, sharding=NamedSharding(mesh, P("x")))}
    np.testing.assert_array_equal(
        np.asarray(fop.restore(url, like=like, partial=True)["e"]), tree["e"]
    )
    # One byte inside a compressed segment of "w" (not its trailer): named on restore.
    name, offset, length = segments["w"][0]
    original = read(f"data/{name}")
    write(f"data/{name}", _flip(original, offset + length // 2))
    (result,) = fop.verify(url)
    assert not result.ok and "'w'" in result.error, result.error
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        fop.restore(url)
    # A damaged shard of the compressed batch names its leaves.
    write(f"data/{name}", original)
    batch = next(b for b in meta["batches"] if b.endswith(".int16"))
    name, offset, length = segments[batch][0]
    write(f"data/{name}", _flip(read(f"data/{name}"), offset + length - 2))
    with pytest.raises(CorruptCheckpointError, match="small/l"):
        fop.restore(url)


def test_local_compressed_segments_round_trip_and_damage_names_the_leaf(tmp_path):
    tree = _tree()
    path = tmp_path / "c"
    fop.save(path, tree, format_version=2, compression="zstd")
    assert sum(os.path.getsize(path / "data" / f) for f in os.listdir(path / "data")) < 3 << 20

    def write(name, data):
        os.chmod(path / name, 0o644)
        (path / name).write_bytes(data)

    _check_compressed_then_damage(lambda n: (path / n).read_bytes(), write, path, tree)


def test_s3_compressed_segments_round_trip_and_damage_names_the_leaf(s3_location):
    tree = _tree()
    fop.save(s3_location.url, tree, format_version=2, compression="zstd")
    kv = s3_location.kvstore()
    _check_compressed_then_damage(
        s3_location.read, lambda n, d: kv.write(n, d).result(), s3_location.url, tree
    )


def test_manager_steps_of_version_2_compress_per_item(tmp_path):
    tree = _tree()
    with fop.CheckpointManager(
        tmp_path / "run", format_version=2, compression={"opt": "zstd:1"}
    ) as m:
        m.save(1, {"params": tree, "opt": tree}, ignore_policy=True)
    item = tmp_path / "run" / "1"
    sizes = {
        d: sum(os.path.getsize(item / d / "data" / f) for f in os.listdir(item / d / "data"))
        for d in ("params", "opt")
    }
    assert sizes["opt"] * 3 < sizes["params"], sizes
    with fop.CheckpointManager(tmp_path / "run", read_only=True) as m:
        got = m.restore()
    _same(tree, got["opt"])
    _same(tree, got["params"])


def test_golden_compressed_v2_checkpoint_restores_bit_exact_and_verifies():
    want = golden.every_leaf_kind()
    path = os.path.join(golden.GOLDEN, "v2_zstd_leaf_kinds")
    meta = json.load(open(os.path.join(path, "_METADATA.json")))
    assert meta["format_version"] == 2
    arrays = [r for r in meta["leaves"] if r.get("storage", {}).get("type") == "array"]
    codecs = {r["storage"]["codec"] for r in arrays}
    assert codecs == {"zstd:3"} and {b["codec"] for b in meta["batches"].values()} == {"zstd:3"}
    out = fop.restore(path, like=want)
    for k in ("f32", "bf16", "u64", "c64", "big", "zero_size"):
        assert np.asarray(out[k]).tobytes() == np.asarray(want[k]).tobytes(), k
    assert out["py_int"] == want["py_int"] and out["none"] is None
    assert all(r.ok for r in fop.verify(path))
