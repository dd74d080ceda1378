"""Every dtype jax.numpy offers, saved and read back bit for bit: both formats, every
kind of storage (batched, own array, compressed), local disk and memory://, sharded
and resharded on 8 devices, verify and incremental reuse. The list is derived from
jax.numpy, so a dtype jax adds later is tested here, or fails the table test."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import plan as _plan
from flax_orbax_plugin._errors import CheckpointError
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._zarr import arrays as _arrays

pytest_plugins = ["_servers"]


def _jax_numpy_dtypes() -> list[str]:
    """The name of every scalar type jax.numpy exports (jnp.int4, jnp.float8_e8m0fnu...)."""
    names = set()
    for attr in dir(jnp):
        obj = getattr(jnp, attr, None)
        dtype = getattr(obj, "dtype", None)
        if isinstance(obj, type) and isinstance(dtype, np.dtype):
            names.add(dtype.name)
    return sorted(names)


ALL = _jax_numpy_dtypes()
SHAPE = (16, 64)  # 1024 elements: several chunks per array below, 8 row shards


def test_the_table_lists_every_jax_numpy_dtype():
    assert len(ALL) >= 30  # the derivation finds jnp.float32, jnp.int4, ... (not nothing)
    assert {"int4", "uint4", "float4_e2m1fn", "float8_e8m0fnu", "float8_e3m4"} <= set(ALL)
    assert set(ALL) == set(_layout.DTYPES), "a dtype missing from _format/layout/dtypes.py"


def _bits_of(name: str) -> np.ndarray:
    """1024 values of dtype ``name`` as bit patterns: every pattern of a 4- or 8-bit
    type, random ones (NaN payloads among them) and explicit NaN payloads of wider floats;
    sub-byte types in their canonical byte (the value's bits, high bits zero)."""
    dtype = _layout.dtype_from_name(name)
    bits = _layout.DTYPES[name].bits
    rng = np.random.default_rng(sum(map(ord, name)))
    count = int(np.prod(SHAPE))
    if name == "bool":
        return rng.integers(0, 2, count).astype(bool).reshape(SHAPE)
    if bits < 8:
        raw = np.arange(count) % (1 << bits)
        return rng.permutation(raw).astype(np.uint8).view(dtype).reshape(SHAPE)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    if dtype.itemsize == 1:
        raw[:256] = np.arange(256, dtype=np.uint8)
    payloads = {2: [0x7E01, 0xFC02, 0x7D55], 4: [0x7FC00001, 0xFF800002, 0x7FA00000]}
    payloads[8] = [0x7FF8000000000001, 0xFFF0000000000002]
    width = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
    if (dtype.kind in "fc" or name == "bfloat16") and width in payloads:
        patterns = np.array(payloads[width], dtype=f"<u{width}")
        words = raw.view(f"<u{width}")
        words[: len(patterns)] = patterns
    return raw.view(dtype).reshape(SHAPE)


def _same_bytes(got, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_the_samples_hold_nan_payloads():
    """The bit-exact tests below compare NaNs with payloads, not only numbers."""
    for name in ("float16", "bfloat16", "float32", "float64", "complex64"):
        values = _bits_of(name)
        real = values.real if values.dtype.kind == "c" else values
        assert np.isnan(real.astype(np.float64)).any(), name
    assert np.isnan(_bits_of("float8_e4m3fn").astype(np.float32)).any()


@pytest.fixture
def small_leaves(monkeypatch):
    """Leaves over 4 KiB get arrays of their own, in chunks of 1 KiB: a small tree
    exercises every storage kind."""
    monkeypatch.setattr(_plan, "SMALL_LEAF_BYTES", 4096)
    monkeypatch.setattr(_arrays, "CHUNK_TARGET_BYTES", 1024)


def _tree(name: str) -> dict:
    values = _bits_of(name)
    big = np.concatenate([values] * 8)  # (128, 64): its own array, several chunks
    return {"big": big, "small": values[:3], "one": values[0, 0].copy(), "zero_d": values[0, 1:2]}


@pytest.mark.parametrize("store", ["local", "local-zstd", "memory"])
@pytest.mark.parametrize("format_version", [1, 2])
@pytest.mark.parametrize("name", ALL)
def test_save_restore_verify_bit_exact(tmp_path, small_leaves, name, format_version, store):
    if store == "memory":
        path = f"memory://every-dtype/{name}-{format_version}"
    else:
        path = str(tmp_path / "c")
    compression = "zstd" if store == "local-zstd" else None
    tree = _tree(name)
    fop.save(path, tree, format_version=format_version, compression=compression)
    got = fop.restore(path)
    for key, want in tree.items():
        _same_bytes(got[key], np.asarray(want))
    info = fop.metadata(path)
    assert {str(leaf.dtype) for leaf in info.leaves.values()} == {name}
    if store != "memory":
        packed = _layout.DTYPES[name].bits < 8
        assert _storage_types(path) == {
            "big": "packed_array" if packed else "array",
            "small": "packed_batch" if packed else "batch",
            "zero_d": "packed_batch" if packed else "batch",
            "one": "batch",  # a numpy scalar: one value, its byte
        }
    (report,) = fop.verify(path)
    assert report.ok, report


@pytest.mark.parametrize("format_version", [1, 2])
def test_every_dtype_on_s3(s3_location, small_leaves, format_version):
    """The real S3 test server: one checkpoint holding every dtype (each in its own
    array, packed where sub-byte, and batched), read back bit for bit and verified."""
    tree = {name: _tree(name) for name in ALL}
    url = f"{s3_location.url}/v{format_version}"
    fop.save(url, tree, format_version=format_version)
    got = fop.restore(url)
    for name in ALL:
        for key, want in tree[name].items():
            _same_bytes(got[name][key], np.asarray(want))
    (report,) = fop.verify(url)
    assert report.ok, report


def _on_devices(name: str) -> bool:
    """Whether jax's CPU backend holds arrays of this dtype (float6 it does not)."""
    dtype = _layout.dtype_from_name(name)
    try:
        return jax.device_put(np.zeros(2, dtype)).dtype == dtype
    except Exception:  # noqa: BLE001 - jax's own refusal of an unknown dtype
        return False


@pytest.mark.parametrize("format_version", [1, 2])
@pytest.mark.parametrize("name", ALL)
def test_sharded_save_and_resharded_restore(tmp_path, devices, small_leaves, name, format_version):
    wide = _layout.dtype_from_name(name).itemsize * 8 >= 64 and name != "complex64"
    with jax.enable_x64(wide):  # jax holds 64-bit values only with x64 on
        _sharded_round_trip(tmp_path, devices, name, format_version)


def _storage_types(path: str) -> dict[str, str]:
    doc = json.loads(open(os.path.join(path, _layout.METADATA_FILE), "rb").read())
    return {r["path"]: r["storage"]["type"] for r in doc["leaves"] if "storage" in r}


def _sharded_round_trip(tmp_path, devices, name, format_version):
    # (32, 66): rows of 66 values, so column shards of 33 start inside a byte when packed
    values = np.resize(_bits_of(name), (32, 66))
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    grid = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
    saved_as = {
        "rows": NamedSharding(mesh, P("x")),  # whole rows per writer: packed if sub-byte
        "cols": NamedSharding(grid, P(None, "b")),  # 33 columns a writer: never packed
    }
    others = [NamedSharding(grid, P("a", "b")), NamedSharding(grid, P(None, "b"))]
    path = str(tmp_path / "c")
    if not _on_devices(name):
        # Host-only dtype: saved from numpy; a restore onto devices is jax's refusal,
        # never a silent value. (When jax's backend learns it, the branch below runs.)
        fop.save(path, {"x": values}, format_version=format_version)
        like = {"x": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=others[0])}
        with pytest.raises(Exception, match=name):
            fop.restore(path, like=like)
        _same_bytes(fop.restore(path)["x"], values)
        return
    tree = {key: jax.device_put(values, sharding) for key, sharding in saved_as.items()}
    fop.save(path, tree, format_version=format_version)
    packed = _layout.DTYPES[name].bits < 8
    assert _storage_types(path) == {"rows": "packed_array" if packed else "array", "cols": "array"}
    for other in others:
        like = {
            key: jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=other) for key in tree
        }
        for got in fop.restore(path, like=like).values():
            assert got.sharding == other
            _same_bytes(got, values)
            for shard in got.addressable_shards:
                _same_bytes(shard.data, values[shard.index])
    assert fop.verify(path)[0].ok


def _stored_bytes(values: np.ndarray) -> int:
    """The bytes of an array as stored: sub-byte values packed, rows to whole bytes."""
    bits = _layout.DTYPES[values.dtype.name].bits
    if bits >= 8:
        return values.nbytes
    return values.size // values.shape[-1] * -(-values.shape[-1] * bits // 8)


@pytest.mark.parametrize("format_version", [1, 2])
@pytest.mark.parametrize("name", ALL)
def test_incremental_step_reuses_every_dtype(tmp_path, small_leaves, name, format_version):
    whole = _tree(name)
    tree = {"params": {"big": whole["big"], "small": whole["small"]}}
    with fop.CheckpointManager(
        str(tmp_path), incremental=True, format_version=format_version
    ) as mngr:
        mngr.save(1, tree)
        mngr.wait()
        mngr.save(2, tree)
        mngr.wait()
        assert mngr.last_save.bytes_reused == _stored_bytes(tree["params"]["big"])
        got = mngr.restore(step=2)
    for key, want in tree["params"].items():
        _same_bytes(got["params"][key], want)


@pytest.mark.parametrize("format_version", [1, 2])
def test_a_dtype_the_reader_does_not_know_is_refused_naming_leaf_and_dtype(
    tmp_path, small_leaves, format_version
):
    """A checkpoint from a newer writer (a dtype this reader's table lacks) is refused by
    metadata, restore and verify, naming the leaf and the dtype: never read as bytes."""
    path = str(tmp_path / "c")
    fop.save(path, _tree("int4"), format_version=format_version)
    meta = os.path.join(path, _layout.METADATA_FILE)
    doc = json.loads(open(meta, "rb").read())
    for record in doc["leaves"]:
        if record["path"] == "big":
            record["dtype"] = "float3_e1m1"
    raw = json.dumps(doc).encode()
    with open(meta, "wb") as f:
        f.write(raw)
    marker = os.path.join(path, _layout.COMMIT_FILE)
    body = json.loads(open(marker, "rb").read())
    body.pop("checksum")
    body["files"][_layout.METADATA_FILE] = _layout.sha256(raw)
    with open(marker, "wb") as f:
        f.write(_layout.seal(body))
    for call in (fop.metadata, fop.restore):
        with pytest.raises(CheckpointError, match=r"'big'.*float3_e1m1|float3_e1m1.*'big'"):
            call(path)
    (report,) = fop.verify(path)
    assert not report.ok and "float3_e1m1" in str(report)
