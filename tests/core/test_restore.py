"""Tests of _restore: resharding, partial restore, casts, and every error it names."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop


def _mesh(shape, names, devices):
    n = int(np.prod(shape))
    return Mesh(np.array(devices[:n]).reshape(shape), names)


@pytest.fixture
def saved(tmp_path, devices):
    """A state sharded over a 2x4 mesh: params and Adam-like moments, plus small leaves."""
    mesh = _mesh((2, 4), ("data", "model"), devices)
    sh = NamedSharding(mesh, P("data", "model"))
    rng = np.random.default_rng(0)
    host = {
        "params": {
            "kernel": rng.standard_normal((256, 512)).astype(np.float32),
            "bias": rng.standard_normal((512,)).astype(np.float32),
        },
        "opt": {"mu": rng.standard_normal((256, 512)).astype(np.float32)},
        "step": 12,
    }
    tree = {
        "params": {
            "kernel": jax.device_put(host["params"]["kernel"], sh),
            "bias": jnp.asarray(host["params"]["bias"]),
        },
        "opt": {"mu": jax.device_put(host["opt"]["mu"], sh)},
        "step": 12,
    }
    fop.save(tmp_path / "c", tree, format_version=1)  # tests below damage its chunk files
    return tmp_path / "c", tree, host


def _abstract(tree, sharding_for):
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_for(x))
            if hasattr(x, "shape")
            else x
        ),
        tree,
    )


@pytest.mark.parametrize(
    "target",
    ["8->4", "2x4->4x2", "replicated", "single-device", "numpy"],
)
def test_reshard_on_restore(saved, devices, target):
    path, tree, host = saved
    if target == "8->4":
        mesh = _mesh((4,), ("x",), devices)
        sharding = NamedSharding(mesh, P("x"))
    elif target == "2x4->4x2":
        mesh = _mesh((4, 2), ("a", "b"), devices)
        sharding = NamedSharding(mesh, P("a", "b"))
    elif target == "replicated":
        sharding = NamedSharding(_mesh((8,), ("x",), devices), P())
    elif target == "single-device":
        sharding = jax.sharding.SingleDeviceSharding(devices[3])
    else:
        sharding = None
    if sharding is None:
        like = jax.tree_util.tree_map(
            lambda x: np.zeros(x.shape, x.dtype) if hasattr(x, "shape") else x, tree
        )
    else:

        def for_leaf(x):
            if x.ndim == 2 or not isinstance(sharding, NamedSharding):
                return sharding
            return NamedSharding(sharding.mesh, P(sharding.mesh.axis_names[0]))

        like = _abstract(tree, for_leaf)
    out = fop.restore(path, like)
    np.testing.assert_array_equal(np.asarray(out["params"]["kernel"]), host["params"]["kernel"])
    np.testing.assert_array_equal(np.asarray(out["opt"]["mu"]), host["opt"]["mu"])
    np.testing.assert_array_equal(np.asarray(out["params"]["bias"]), host["params"]["bias"])
    assert out["step"] == 12 and type(out["step"]) is int
    if sharding is None:
        assert isinstance(out["params"]["kernel"], np.ndarray)
    else:
        assert out["params"]["kernel"].sharding == sharding


def test_restore_with_like_none_gives_numpy(saved):
    path, _, host = saved
    out = fop.restore(path)
    assert isinstance(out["opt"]["mu"], np.ndarray)
    np.testing.assert_array_equal(out["opt"]["mu"], host["opt"]["mu"])


def test_restore_from_eval_shape_template(saved, devices):
    path, _, host = saved
    sharding = NamedSharding(_mesh((8,), ("x",), devices), P("x"))

    def init():
        return {"kernel": jnp.zeros((256, 512)), "bias": jnp.zeros((512,))}

    abstract = jax.eval_shape(init)
    abstract = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract
    )
    out = fop.restore(path, {"params": abstract}, partial=True)
    np.testing.assert_array_equal(out["params"]["kernel"], host["params"]["kernel"])


def test_partial_restore_reads_only_requested_leaves(saved):
    path, tree, host = saved
    # Remove everything but params' data: a partial restore must not need it.
    doc = json.loads((path / "_METADATA.json").read_text())
    for i, rec in enumerate(doc["leaves"]):
        if rec["path"].startswith("opt/"):
            for root, _, files in os.walk(path / "d" / str(i)):
                for f in files:
                    os.remove(os.path.join(root, f))
    like = {"params": jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype), tree["params"])}
    out = fop.restore(path, like, partial=True)
    np.testing.assert_array_equal(out["params"]["kernel"], host["params"]["kernel"])
    with pytest.raises(fop.CorruptCheckpointError, match="opt/mu"):
        fop.restore(path)


def test_dtype_in_like_casts(saved):
    path, tree, host = saved
    like = {
        "params": {
            "kernel": jax.ShapeDtypeStruct((256, 512), jnp.bfloat16),
            "bias": np.zeros((512,), np.float16),
        }
    }
    out = fop.restore(path, like, partial=True)
    assert out["params"]["kernel"].dtype == jnp.bfloat16
    assert out["params"]["bias"].dtype == np.float16
    np.testing.assert_array_equal(
        np.asarray(out["params"]["kernel"]), host["params"]["kernel"].astype(jnp.bfloat16)
    )


def test_missing_key_names_leaf(saved):
    path, tree, _ = saved
    like = dict(tree, extra={"ema": np.zeros(3)})
    with pytest.raises(fop.StructureError, match=r"leaf 'extra/ema'.*no such key"):
        fop.restore(path, like)


def test_unexpected_key_names_leaf(saved):
    path, tree, _ = saved
    like = {k: v for k, v in tree.items() if k != "opt"}
    with pytest.raises(fop.StructureError, match=r"leaf 'opt/mu'.*unexpected key.*partial=True"):
        fop.restore(path, like)


def test_shape_mismatch_names_leaf_expected_and_found(saved):
    path, tree, _ = saved
    like = jax.tree_util.tree_map(lambda x: x, tree)
    like["params"]["bias"] = np.zeros((256,), np.float32)
    with pytest.raises(
        fop.StructureError, match=r"leaf 'params/bias'.*expected \(256,\).*found \(512,\)"
    ):
        fop.restore(path, like)


def test_unknown_dtype_names_leaf(saved):
    path, _, _ = saved
    meta = path / "_METADATA.json"
    doc = json.loads(meta.read_text())
    rec = next(r for r in doc["leaves"] if r["path"] == "params/kernel")
    rec["dtype"] = "float7_e9"
    _reseal(path, json.dumps(doc).encode())
    with pytest.raises(fop.CorruptCheckpointError, match=r"'params/kernel'.*dtype.*'float7_e9'"):
        fop.restore(path)


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(fop.CheckpointNotFoundError, match="does not exist"):
        fop.restore(tmp_path / "nope")
    with pytest.raises(fop.CheckpointNotFoundError):
        fop.metadata(tmp_path / "nope")


def test_uncommitted_path_is_refused(saved):
    path, _, _ = saved
    os.remove(path / "_COMMITTED")
    with pytest.raises(fop.NotCommittedError, match="not a committed checkpoint"):
        fop.restore(path)
    assert not fop.is_committed(path)


def _flip_byte(file_path, offset=100):
    with open(file_path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_flipped_byte_in_array_names_leaf(saved):
    path, _, _ = saved
    doc = json.loads((path / "_METADATA.json").read_text())
    index = next(i for i, r in enumerate(doc["leaves"]) if r["path"] == "opt/mu")
    chunk_dir = path / "d" / str(index) / "c"
    first = sorted(os.path.join(r, f) for r, _, fs in os.walk(chunk_dir) for f in fs)[0]
    _flip_byte(first)
    with pytest.raises(fop.CorruptCheckpointError, match=r"leaf 'opt/mu'.*damaged"):
        fop.restore(path)
    like = {"params": {"bias": np.zeros(512, np.float32)}}
    fop.restore(path, like, partial=True)  # other leaves still readable


def test_flipped_byte_in_batch_names_leaf(tmp_path):
    tree = {f"s{i}": np.full((25_000,), i, np.float32) for i in range(8)}  # 100 kB each
    fop.save(tmp_path / "c", tree, format_version=1)
    (batch,) = [
        os.path.join(r, f)
        for r, _, fs in os.walk(tmp_path / "c" / "b")
        for f in fs
        if "zarr.json" not in f
    ]
    _flip_byte(batch, offset=550_000)  # the middle of leaf s5
    with pytest.raises(fop.CorruptCheckpointError) as info:
        fop.restore(tmp_path / "c")
    assert "leaf 's5'" in str(info.value) and "s4" not in str(info.value)
    out = fop.restore(tmp_path / "c", {"s4": np.zeros(25_000, np.float32)}, partial=True)
    np.testing.assert_array_equal(out["s4"], tree["s4"])


def test_missing_chunk_is_an_error_not_zeros(saved):
    path, _, _ = saved
    doc = json.loads((path / "_METADATA.json").read_text())
    index = next(i for i, r in enumerate(doc["leaves"]) if r["path"] == "params/kernel")
    chunk_dir = path / "d" / str(index) / "c"
    victim = sorted(os.path.join(r, f) for r, _, fs in os.walk(chunk_dir) for f in fs)[-1]
    os.remove(victim)
    with pytest.raises(fop.CorruptCheckpointError, match="params/kernel"):
        fop.restore(path)


def test_hostile_metadata_cannot_name_outside_paths(saved):
    path, _, _ = saved
    meta = path / "_METADATA.json"
    doc = json.loads(meta.read_text())
    doc["batches"] = {"../../etc": {"dtype": "float32", "process": 0, "size": 4, "chunk": 4}}
    meta.write_text(json.dumps(doc))
    with pytest.raises(fop.CorruptCheckpointError, match="checksum mismatch"):
        fop.restore(path)
    _reseal(path, json.dumps(doc).encode())  # consistent checksums: validation catches it
    with pytest.raises(fop.CorruptCheckpointError, match="malformed .*batches"):
        fop.restore(path)
    _reseal(path, b"{not json")
    with pytest.raises(fop.CorruptCheckpointError, match="not valid JSON"):
        fop.metadata(path)


def _reseal(path, raw: bytes) -> None:
    """Replaces _METADATA.json and the checksum its commit marker records (a crafted
    checkpoint, not an accidental change)."""
    from flax_orbax_plugin._format import layout as _layout

    (path / "_METADATA.json").write_bytes(raw)
    body = json.loads((path / "_COMMITTED").read_bytes())
    body.pop("checksum")
    body["files"]["_METADATA.json"] = _layout.sha256(raw)
    (path / "_COMMITTED").write_bytes(_layout.seal(body))


def test_metadata_reads_no_array_data(saved):
    path, _, _ = saved
    for root, _, files in os.walk(path / "d"):
        for f in files:
            os.remove(os.path.join(root, f))
    info = fop.metadata(path)
    assert info.leaves["params/kernel"].shape == (256, 512)
    assert info.leaves["params/kernel"].sharding["spec"] == ["data", "model"]
    assert info.leaves["step"].kind == "py_int"
    assert info.total_bytes == 256 * 512 * 4 * 2 + 512 * 4 + 8


def test_a_sharded_leaf_restores_into_pinned_host_memory(tmp_path):
    """Each shard was put in the device's default memory, and jax refused to assemble
    them into a pinned_host sharding ('Memory kind mismatch with xla::PjRtBuffers')."""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    fop.save(tmp_path / "a", {"f": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("d")))})
    pinned = NamedSharding(mesh, P("d"), memory_kind="pinned_host")
    like = {"f": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=pinned)}
    got = fop.restore(tmp_path / "a", like=like)["f"]
    assert got.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(got), np.arange(16.0))
