"""_safetensors: sharded export and resharding import, against the safetensors library."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.flax
import safetensors.numpy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._errors import CorruptCheckpointError, StructureError
from flax_orbax_plugin._interop import safetensors as _safetensors
from flax_orbax_plugin._interop.safetensors import reader as _safetensors_reader


def _params():
    rng = np.random.default_rng(0)
    return {
        "Dense_0": {
            "kernel": rng.standard_normal((64, 32), dtype=np.float32),
            "bias": rng.standard_normal(32, dtype=np.float32),
        },
        "Conv_0": {"kernel": rng.standard_normal((3, 3, 4, 8), dtype=np.float32)},
        "Embed_0": {"embedding": rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16)},
        "count": np.arange(10, dtype=np.int64),
        "mask": np.array([True, False, True]),
    }


def test_parse_size_counts_like_hugging_face():
    assert _safetensors.parse_size("5GB") == 5 * 10**9
    assert _safetensors.parse_size("2MB") == 2 * 10**6
    assert _safetensors.parse_size("2mb") == 2 * 10**6
    assert _safetensors.parse_size("1GiB") == 2**30
    assert _safetensors.parse_size("500KiB") == 500 * 2**10
    assert _safetensors.parse_size("1.5GB") == 1_500_000_000
    assert _safetensors.parse_size(12345) == 12345
    assert _safetensors.parse_size("100") == 100
    for bad in ("5 parsecs", "GB", "", "-1MB", "0", 0, None):
        with pytest.raises(ValueError, match="max shard size"):
            _safetensors.parse_size(bad)


def test_sharded_export_read_by_the_safetensors_library(tmp_path):
    params = _params()
    out = tmp_path / "hf"
    result = _safetensors.to_safetensors(params, out, max_shard_size="4KB")
    assert result.index == str(out / "model.safetensors.index.json")
    n = len(result.files)
    assert n > 2
    assert [os.path.basename(f) for f in result.files] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    sizes = {"Dense_0.kernel": 8192, "Dense_0.bias": 128, "Conv_0.kernel": 1152}
    assert (
        index["metadata"]["total_size"]
        == result.total_bytes
        == sum(np.asarray(v).nbytes for v in jax.tree.leaves(params))
    )
    loaded = {}
    for f in result.files:
        with safetensors.safe_open(f, framework="numpy") as handle:
            # Flax layout (not transposed), and the marker that lets a later --force
            # prove the file is ours
            assert handle.metadata() == {"format": "flax", "flax_orbax_plugin": "1"}
            names = list(handle.keys())
        assert all(index["weight_map"][k] == os.path.basename(f) for k in names)
        # no file above the limit unless it holds one tensor larger than the limit
        assert os.path.getsize(f) < 4000 + 1024 or sizes.get(names[0], 0) > 4000
        loaded.update(safetensors.numpy.load_file(f))
    assert (
        sorted(loaded)
        == sorted(index["weight_map"])
        == sorted(
            [
                "Conv_0.kernel",
                "Dense_0.bias",
                "Dense_0.kernel",
                "Embed_0.embedding",
                "count",
                "mask",
            ]
        )
    )
    flat = {p.replace("/", "."): v for p, v in _flat_paths(params)}
    for name, value in flat.items():
        got = np.asarray(loaded[name])
        assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), name
    # under the limit: one file, no index
    single = _safetensors.to_safetensors(params, tmp_path / "one.safetensors")
    assert single.files == (str(tmp_path / "one.safetensors"),) and single.index is None
    assert not (tmp_path / "one.safetensors.index.json").exists()
    assert sorted(safetensors.numpy.load_file(single.files[0])) == sorted(flat)


def _flat_paths(tree):
    return [
        ("/".join(str(k.key) for k in p), np.asarray(v))
        for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def test_key_map_and_transposed_kernels_round_trip(tmp_path, devices):
    params = _params()

    def to_hf(path):
        if path.startswith("count"):
            return None  # left out
        return "model." + path.replace("/", ".").replace("kernel", "weight")

    out = tmp_path / "pt"
    _safetensors.to_safetensors(
        params, out, key_map=to_hf, transpose_kernels=True, max_shard_size="8KB"
    )
    loaded = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            loaded.update(safetensors.numpy.load_file(str(out / name)))
    assert "count" not in loaded and "model.count" not in loaded
    np.testing.assert_array_equal(loaded["model.Dense_0.weight"], params["Dense_0"]["kernel"].T)
    np.testing.assert_array_equal(  # conv (h, w, in, out) -> (out, in, h, w)
        loaded["model.Conv_0.weight"], params["Conv_0"]["kernel"].transpose(3, 2, 0, 1)
    )
    # back, with the same key_map, onto a 2x4 mesh
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    like = jax.eval_shape(lambda: {k: v for k, v in params.items() if k != "count"})
    like["Dense_0"]["kernel"] = jax.ShapeDtypeStruct(
        (64, 32), jnp.float32, sharding=NamedSharding(mesh, P("b", "a"))
    )
    got = _safetensors.from_safetensors(out, like, key_map=to_hf, transpose_kernels=True)
    kernel = got["Dense_0"]["kernel"]
    assert kernel.sharding == like["Dense_0"]["kernel"].sharding
    for shard in kernel.addressable_shards:
        np.testing.assert_array_equal(
            np.asarray(shard.data), params["Dense_0"]["kernel"][shard.index]
        )
    for path, value in _flat_paths({k: v for k, v in params.items() if k != "count"}):
        node = got
        for part in path.split("/"):
            node = node[part]
        assert np.asarray(node).tobytes() == value.tobytes(), path


def test_reads_files_written_by_the_safetensors_library(tmp_path, devices):
    rng = np.random.default_rng(1)
    tensors = {
        "w": jnp.asarray(rng.standard_normal((32, 16), dtype=np.float32)),
        "h": jnp.asarray(rng.standard_normal((8, 8)), dtype=jnp.bfloat16),
        "i": jnp.arange(12, dtype=jnp.int32).reshape(3, 4),
    }
    safetensors.flax.save_file(tensors, str(tmp_path / "a.safetensors"), metadata={"k": "v"})
    safetensors.flax.save_file({"extra": jnp.ones(3, jnp.float16)}, str(tmp_path / "b.safetensors"))
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    like = {
        "w": jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
        "h": jax.ShapeDtypeStruct((8, 8), jnp.float32),  # bf16 -> f32 is lossless
        "i": np.zeros((3, 4), np.int64),  # int32 -> int64 too
        "extra": jax.ShapeDtypeStruct((3,), jnp.float16),
    }
    got = _safetensors.from_safetensors(files, like)
    assert got["w"].sharding == like["w"].sharding
    assert [s.data.shape for s in got["w"].addressable_shards] == [(4, 16)] * 8
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(tensors["w"]))
    np.testing.assert_array_equal(np.asarray(got["h"]), np.asarray(tensors["h"]).astype(np.float32))
    assert isinstance(got["i"], np.ndarray) and got["i"].dtype == np.int64
    # like=None: every tensor as numpy, named as in the files
    plain = _safetensors.from_safetensors(files)
    assert sorted(plain) == ["extra", "h", "i", "w"] and plain["h"].dtype == ml_dtypes.bfloat16


def test_import_checks_like_the_restore(tmp_path):
    path = tmp_path / "m.safetensors"
    w = np.random.default_rng(2).standard_normal((4, 6), dtype=np.float32)
    safetensors.numpy.save_file({"w": w, "n": np.arange(3, dtype=np.int64)}, str(path))
    with pytest.raises(StructureError, match=r"leaf 'w'.*\(6, 4\).*\(4, 6\)"):
        _safetensors.from_safetensors(path, {"w": jax.ShapeDtypeStruct((6, 4), jnp.float32)})
    with pytest.raises(
        StructureError, match=r"leaf 'w'.*bfloat16.*float32.*changes values \(pass cast='unsafe'"
    ):
        _safetensors.from_safetensors(
            path, {"w": jax.ShapeDtypeStruct((4, 6), jnp.bfloat16)}, partial=True
        )
    with pytest.raises(StructureError, match=r"truncates.*; pass cast='unsafe' to cast any"):
        _safetensors.from_safetensors(path, {"w": np.zeros((4, 6), np.int32)}, partial=True)
    # a narrowing cast whose values all fit passes; cast='unsafe' is the explicit opt-in
    small = _safetensors.from_safetensors(path, {"n": np.zeros(3, np.int8)}, partial=True)
    assert small["n"].dtype == np.int8 and small["n"].tolist() == [0, 1, 2]
    bf16 = {"w": jax.ShapeDtypeStruct((4, 6), jnp.bfloat16)}
    cast = _safetensors.from_safetensors(path, bf16, partial=True, cast="unsafe")
    assert cast["w"].dtype == jnp.bfloat16
    with pytest.warns(
        DeprecationWarning, match=r"allow_cast=True\) is deprecated: write cast='unsafe'"
    ):
        old = _safetensors.from_safetensors(path, bf16, partial=True, allow_cast=True)
    np.testing.assert_array_equal(np.asarray(old["w"]), np.asarray(cast["w"]))
    with pytest.raises(fop.OptionError, match=r"cast= and allow_cast= given together"):
        _safetensors.from_safetensors(path, bf16, partial=True, cast="unsafe", allow_cast=True)
    with pytest.raises(fop.OptionError, match=r"cast must be one of"):
        _safetensors.from_safetensors(path, bf16, partial=True, cast=True)
    with pytest.raises(StructureError, match=r"tensor 'n'.*no leaf of like"):
        _safetensors.from_safetensors(path, {"w": jax.ShapeDtypeStruct((4, 6), jnp.float32)})
    with pytest.raises(StructureError, match=r"leaf 'missing'.*no such tensor"):
        _safetensors.from_safetensors(path, {"missing": None}, partial=True)


def test_malformed_files_and_indexes(tmp_path):
    good = tmp_path / "good.safetensors"
    safetensors.numpy.save_file({"a": np.ones(4, np.float32)}, str(good))
    raw = good.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["a"]["data_offsets"] = [0, 64]  # past the end of the data
    body = json.dumps(header).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])
    with pytest.raises(CorruptCheckpointError, match=r"bad.safetensors: tensor 'a'.*data_offsets"):
        _safetensors.from_safetensors(bad)
    (tmp_path / "huge.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CorruptCheckpointError, match="header length"):
        _safetensors.from_safetensors(tmp_path / "huge.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "../good.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="file name beside the index"):
        _safetensors.from_safetensors(index)
    index.write_text(json.dumps({"weight_map": {"b": "good.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="does not hold it"):
        _safetensors.from_safetensors(tmp_path)


def test_cli_export_sharded_force_and_stale_shards(tmp_path, capsys):
    directory = tmp_path / "ckpts"
    params = _params()
    with fop.CheckpointManager(directory) as mngr:
        mngr.save(5, {"params": params})
    out = tmp_path / "export"
    rc = cli.main(["export", str(directory), str(out), "--max-shard-size", "4KB"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert "model.safetensors.index.json" in stdout
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) > 2
    # the library's view of the index equals the params
    got = _safetensors.from_safetensors(out, jax.tree.map(np.zeros_like, params))
    for path, value in _flat_paths(params):
        node = got
        for part in path.split("/"):
            node = node[part]
        assert node.tobytes() == value.tobytes()
    # again: refused without --force, nothing changed
    rc = cli.main(["export", str(directory), str(out), "--max-shard-size", "4KB"])
    _, err = capsys.readouterr()
    assert rc == cli.EXIT_ERROR and "--force" in err
    # with --force and a larger limit: one file; the old index and shards are gone
    assert cli.main(["export", str(directory), str(out), "--max-shard-size", "1MB", "--force"]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    # and back to shards: the unsharded file does not linger beside the index
    assert cli.main(["export", str(directory), str(out), "--max-shard-size", "8kb", "--force"]) == 0
    assert "model.safetensors" not in os.listdir(out)
    assert "model.safetensors.index.json" in os.listdir(out)
    rc = cli.main(["export", str(directory), str(out / "x.safetensors"), "--max-shard-size", "x"])
    _, err = capsys.readouterr()
    assert rc == cli.EXIT_ERROR and "max shard size" in err


def test_cli_export_key_map_file_and_transpose(tmp_path, capsys):
    directory = tmp_path / "ckpts"
    params = _params()
    with fop.CheckpointManager(directory) as mngr:
        mngr.save(1, {"params": params})
    key_map = tmp_path / "names.json"
    key_map.write_text(json.dumps({"Dense_0/kernel": "fc.weight", "count": None}))
    out = tmp_path / "m.safetensors"
    argv = ["export", str(directory), str(out), "--key-map", str(key_map), "--transpose-kernels"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    loaded = safetensors.numpy.load_file(str(out))
    assert "count" not in loaded and "Dense_0.kernel" not in loaded
    np.testing.assert_array_equal(loaded["fc.weight"], params["Dense_0"]["kernel"].T)
    np.testing.assert_array_equal(loaded["Dense_0.bias"], params["Dense_0"]["bias"])


def _rchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def test_a_region_read_reads_only_its_bytes(tmp_path):
    """Each region comes from one pread per contiguous run: the bytes read are the
    region's (the kernel's rchar counter), and the values equal numpy's slicing."""
    full = np.arange(64 * 48 * 4, dtype=np.float32).reshape(64, 48, 4)
    path = tmp_path / "big.safetensors"
    safetensors.numpy.save_file({"x": full}, str(path))
    (stored,) = _safetensors.read_safetensors_index(path).values()
    files = _safetensors_reader._Files()
    try:
        read = files.reader(stored, None)
        for index in [
            (slice(16, 32), slice(None), slice(None)),  # rows: one run
            (slice(None), slice(12, 24), slice(None)),  # columns: one run per row
            (slice(8, 16), slice(0, 48), slice(1, 3)),  # innermost axis cut
            (slice(0, 0), slice(None), slice(None)),  # empty
        ]:
            before = _rchar()
            got = read(index)
            nbytes = _rchar() - before
            np.testing.assert_array_equal(got, full[index])
            # rchar also counts reading /proc/self/io itself (about 120 bytes)
            assert full[index].nbytes <= nbytes <= full[index].nbytes + 256, index
        back = files.reader(stored, (2, 1, 0))  # stored in a transposed layout
        np.testing.assert_array_equal(
            back((slice(1, 3), slice(5, 9), slice(10, 20))),
            full.transpose(2, 1, 0)[1:3, 5:9, 10:20],
        )
    finally:
        files.close()


def test_each_process_reads_only_its_regions(tmp_path):
    """Two real jax processes restore one tensor sharded over both: each reads about
    half of its bytes and holds exactly its rows."""
    from _multiprocess import run_processes

    rows, cols = 1024, 512  # 2 MiB of float32
    full = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": full}, str(path))
    result = run_processes(
        "_safetensors_workers:read_sharded",
        2,
        devices_per_process=2,
        args={"path": str(path), "rows": rows, "cols": cols},
        timeout_s=120,
    )
    for proc in result.procs:
        assert proc.record.get("ok"), proc.record.get("traceback") or proc.record
        out = proc.record["result"]
        assert out["rows_ok"] and out["shard_rows"] == rows // 4
        assert full.nbytes // 2 <= out["bytes_read"] < full.nbytes // 2 + (64 << 10), out


def test_scalar_leaves_of_a_checkpoint_export_as_0d_tensors(tmp_path):
    """A saved scalar (shape ()) stays shape () in the file: it was written 1-D before."""
    directory = tmp_path / "ckpts"
    with fop.CheckpointManager(directory) as mngr:
        mngr.save(1, {"params": {"n": np.float32(0.5), "w": np.ones((2, 3), np.float32)}})
    out = tmp_path / "s.safetensors"
    assert cli.main(["export", str(directory), str(out)]) == 0
    got = safetensors.numpy.load_file(str(out))
    assert got["n"].shape == () and got["n"] == np.float32(0.5)
    assert _safetensors.from_safetensors(out)["n"].shape == ()


def _header_bytes(path) -> bytes:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return f.read(size)


@pytest.mark.parametrize("sharded", [False, True])
def test_an_export_writes_nothing_machine_specific(tmp_path, capsys, sharded):
    """The header (a file people publish) names at most the step and the item, never
    the exporting machine's path to the checkpoint (issue 32)."""
    directory = tmp_path / "secret-home" / "ckpts"
    with fop.CheckpointManager(directory) as mngr:
        mngr.save(5, {"params": _params()})
    out = tmp_path / "published"
    argv = ["export", str(directory), str(out)] + (["--max-shard-size", "4KB"] if sharded else [])
    assert cli.main(argv) == 0, capsys.readouterr().err
    files = sorted(out.iterdir())
    assert len(files) > 2 if sharded else len(files) == 1
    for file in files:
        raw = file.read_bytes() if file.name.endswith(".json") else _header_bytes(file)
        assert b"secret-home" not in raw and str(tmp_path).encode() not in raw, file.name
    with safetensors.safe_open(str(files[0]), framework="numpy") as f:
        meta = f.metadata()
    assert meta == {
        "format": "flax",
        "step": "5",
        "item": "params",
        "exported_by": "flax-orbax",
        "flax_orbax_plugin": "1",
    }
    # a standalone core checkpoint: no step, no item, still no path
    fop.save(tmp_path / "secret-home" / "core", _params())
    _safetensors.export_checkpoint(tmp_path / "secret-home" / "core", tmp_path / "c.safetensors")
    assert b"secret-home" not in _header_bytes(tmp_path / "c.safetensors")


def test_colliding_default_names_round_trip_without_a_key_map(tmp_path):
    """'a.b' and 'a/b' would both be tensor 'a.b': the export names every tensor by its
    full path then, and from_safetensors now reads them back by the same rule (it looked
    for 'a.b' and refused the file)."""
    tree = {"a.b": np.ones(2, np.float32), "a": {"b": np.zeros(2, np.float32)}}
    fop.to_safetensors(tree, tmp_path / "m.safetensors")
    got = fop.from_safetensors(tmp_path / "m.safetensors", like=tree)
    np.testing.assert_array_equal(got["a.b"], tree["a.b"])
    np.testing.assert_array_equal(got["a"]["b"], tree["a"]["b"])


def test_hf_shards_refuse_a_dtype_that_overflows_a_value(tmp_path):
    """HFShards(dtype='float16') turned 1e5 into inf and committed the step (numpy's
    RuntimeWarning only), where to_safetensors refuses it. Refused now, naming the
    leaf, and no step is committed with the wrong values."""
    params = {"d": {"kernel": np.array([1e5, 1.0], np.float32)}}
    shards = fop.HFShards(every_steps=1, dtype="float16")
    with pytest.raises(fop.StructureError, match=r"HFShards: leaf 'd/kernel'.*overflows"):
        with fop.CheckpointManager(tmp_path / "run", hf_shards=shards) as mngr:
            mngr.save(1, {"params": params}, ignore_policy=True)
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == []
    fine = {"d": {"kernel": np.array([1.5, 1.0], np.float32)}}
    with fop.CheckpointManager(tmp_path / "ok", hf_shards=shards) as mngr:
        mngr.save(1, {"params": fine}, ignore_policy=True)
    assert fop.CheckpointManager(tmp_path / "ok", read_only=True).steps() == [1]


def test_a_prng_key_leaf_is_refused_naming_it(tmp_path):
    """jax's 'JAX array with PRNGKey dtype cannot be converted to a NumPy array' came out
    raw, naming no leaf."""
    tree = {"rng": jax.random.key(0), "w": jnp.ones(2)}
    with pytest.raises(fop.StructureError, match=r"leaf 'rng': .*PRNG key"):
        fop.to_safetensors(tree, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
