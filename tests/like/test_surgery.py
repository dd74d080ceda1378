"""Layout surgery on restore (issue 36, item 2): surgery=[fop.Stack, Unstack, Fuse,
Split, Transpose, Rename], composed with transform=, during the sharded read (each
target shard reads only the saved regions it covers: bytes read measured against the
target's), dry_run plans, one listing of every difference; both formats, local disk
and the S3 test server, through fop.restore, the manager and restore_params."""

from __future__ import annotations

import _docs
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import flax_orbax_plugin as fop
from flax_orbax_plugin._format.steps import read_document
from flax_orbax_plugin._storage.location import Location

pytest_plugins = ["_servers"]

N, ROWS, COLS = 8, 128, 1024  # 8 layers of 512 KiB: the data dwarfs the metadata


def _per_layer(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        f"layers_{i}": {
            "w": rng.standard_normal((ROWS, COLS), dtype=np.float32),
            "b": rng.standard_normal(COLS, dtype=np.float32),  # small: batched
        }
        for i in range(N)
    }


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _s3_bytes() -> int:
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/bytes_read")
    return sum(v.get("value", 0) for m in found for v in m["values"])


def _sharding(spec: PartitionSpec, shape=(N,)) -> NamedSharding:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("a", "b")[: len(shape)])
    return NamedSharding(mesh, spec)


@pytest.mark.parametrize("format_version", [1, 2])
def test_stack_unstack_fuse_split_transpose_rename_equal_numpy(tmp_path, format_version):
    """Each operation gives what numpy's stack/split/concatenate/transpose give, alone
    and chained, after transform= renamed the saved paths."""
    tree = {"model": _per_layer()}
    rng = np.random.default_rng(1)
    tree["model"]["qkv"] = rng.standard_normal((16, 48), dtype=np.float32)
    path = tmp_path / "c"
    fop.save(path, tree, format_version=format_version)
    layers = tree["model"]
    w = np.stack([layers[f"layers_{i}"]["w"] for i in range(N)])
    b = np.stack([layers[f"layers_{i}"]["b"] for i in range(N)], axis=1)  # a new last axis
    like = {
        "scan": {"w": np.zeros_like(w), "b": np.zeros_like(b)},
        "qk": np.zeros((16, 32), np.float32),
        "vT": np.zeros((16, 16), np.float32),
    }
    surgery = [
        fop.Stack("scan/w", "layers_{i}/w"),
        fop.Stack("scan/b", [f"layers_{i}/b" for i in range(N)], axis=-1),
        fop.Split("qkv", ["q", "k", "v"], axis=1, sizes=[16, 16, 16]),
        fop.Transpose("v", (1, 0)),
        fop.Rename("v", "vT"),
        fop.Fuse("qk", ["q", "k"], axis=1),  # split, then fused again
    ]
    out = fop.restore(path, like, transform={r"^model/": ""}, surgery=surgery)
    qkv = layers["qkv"]
    np.testing.assert_array_equal(out["scan"]["w"], w)
    np.testing.assert_array_equal(out["scan"]["b"], b)
    np.testing.assert_array_equal(out["qk"], qkv[:, :32])
    np.testing.assert_array_equal(out["vT"], qkv[:, 32:].T)

    # and back: the stacked leaves saved, per-layer leaves restored (prefix form)
    stacked = {"layers": {"w": w, "b": b.T.copy()}, "qkv": qkv}
    fop.save(tmp_path / "s", stacked, format_version=format_version)
    zeros = {"w": np.zeros((ROWS, COLS), np.float32), "b": np.zeros(COLS, np.float32)}
    like = {f"layers_{i}": dict(zeros) for i in range(N)}
    like["qkv"] = np.zeros((16, 48), np.float32)
    out = fop.restore(tmp_path / "s", like, surgery=[fop.Unstack("layers/", "layers_{i}/")])
    for i in range(N):
        np.testing.assert_array_equal(out[f"layers_{i}"]["w"], layers[f"layers_{i}"]["w"])
        np.testing.assert_array_equal(out[f"layers_{i}"]["b"], layers[f"layers_{i}"]["b"])
    np.testing.assert_array_equal(out["qkv"], qkv)


def test_dry_run_plan_names_saved_leaves_and_ranges_and_reads_no_data(tmp_path):
    tree = {"qkv": np.arange(4 * 12, dtype=np.float32).reshape(4, 12), "n": np.ones(3)}
    tree["big"] = np.ones((1024, 1024), np.float32)  # 4 MiB a real read would take
    fop.save(tmp_path / "c", tree)
    like = {"k": np.zeros((4, 4), np.float32), "vT": np.zeros((4, 4), np.float32)}
    like["big"] = np.zeros((1024, 1024), np.float32)
    before = _rchar()
    plan = fop.restore(
        tmp_path / "c",
        like,
        partial=True,
        surgery=[
            fop.Split("qkv", ["q", "k", "v"], axis=1),
            fop.Transpose("v", (1, 0)),
            fop.Rename("v", "vT"),
        ],
        dry_run=True,
    )
    read = _rchar() - before
    assert isinstance(plan, fop.RestorePlan)
    assert [e.path for e in plan.entries] == ["big", "k", "vT"]
    assert plan.entry("big").sources == (("big", ((0, 1024), (0, 1024))),)
    assert plan.entry("big").how == "as saved"
    k, vt = plan.entry("k"), plan.entry("vT")
    assert k.sources == (("qkv", ((0, 4), (4, 8))),) and k.shape == (4, 4)
    assert vt.sources == (("qkv", ((0, 4), (8, 12))),) and vt.dtype == "float32"
    assert "Transpose" in vt.how and "Rename" in vt.how
    assert plan.dropped == ("n",)
    text = str(plan)
    assert "qkv[0:4, 8:12]" in text and "vT float32[4, 4]" in text
    assert read < 256 << 10, read  # the metadata only (rchar counts it), not big's 4 MiB


def test_every_difference_is_listed_and_bad_operations_refused_before_reading(tmp_path):
    tree = _per_layer()
    tree["layers_3"]["w"] = np.zeros((ROWS, COLS + 1), np.float32)  # one layer wider
    del tree["layers_5"]  # a gap
    tree["qkv"] = np.zeros((4, 10), np.float32)
    fop.save(tmp_path / "c", tree)
    like = {
        "scan": {"w": np.zeros((N, ROWS, COLS), np.float32), "b": np.zeros((N, 5), np.float32)},
        "q": np.zeros((4, 5), np.float32),
        "k": np.zeros((4, 5), np.float32),
    }
    with pytest.raises(fop.StructureError) as e:
        fop.restore(
            tmp_path / "c",
            like,
            surgery=[
                fop.Stack("scan/", "layers_{i}/"),
                fop.Split("qkv", ["q", "k", "v"], axis=1),  # 10 columns in 3 parts
                fop.Transpose("absent", (1, 0)),
            ],
        )
    text = str(e.value)
    assert "'scan/w'" in text and "found no layer [5]" in text  # the gap, per leaf
    assert "'scan/b'" in text
    assert "'qkv'" in text and "a multiple of 3" in text and "[4, 10]" in text
    assert "'absent'" in text and "no such leaf" in text
    assert "'layers_0/w'" in text  # left unread: an unexpected key, as without surgery
    assert "'q'" in text and "expected by like" in text
    # a made leaf that does not fit like: like's shape and what surgery made
    fop.save(tmp_path / "d", {"qkv": np.zeros((4, 12), np.float32)})
    with pytest.raises(fop.StructureError, match=r"'q'.*\(4, 5\).*\(4, 4\).*Split"):
        fop.restore(
            tmp_path / "d",
            {"q": np.zeros((4, 5))},
            partial=True,
            surgery=[fop.Split("qkv", ["q", "k", "v"], axis=1)],
        )
    for bad, what in [
        (fop.Stack, ("w", "layers/w")),  # no {i}
        (fop.Transpose, ("w", (0, 0))),
        (fop.Split, ("w", ["a", "b"], 0, [1])),
        (fop.Unstack, ("w/", "layers_{i}")),  # a prefix onto a leaf
    ]:
        with pytest.raises(fop.TransformError):
            bad(*what)
    with pytest.raises(fop.TransformError, match=r"surgery\[0\]"):
        fop.restore(tmp_path / "d", {"q": np.zeros((4, 4))}, surgery=["Stack"])


def _read_bytes(restore) -> tuple[int, object]:
    """The fewest bytes (rchar) one of two runs of ``restore()`` read, and its result:
    rchar also counts what other threads of this process read meanwhile (the heartbeat,
    a lazy import), never less than the restore itself."""
    counts = []
    for _ in range(2):
        before = _rchar()
        out = restore()
        counts.append(_rchar() - before)
    return min(counts), out


def _chunk_bytes(path, leaf: str, region: tuple[slice, ...]) -> int:
    """The bytes of the saved chunks of ``leaf`` that ``region`` touches: the least a
    read can take (every chunk carries one checksum over all of it)."""
    doc = read_document(Location.from_path(path))
    record = next(r for r in doc.leaves if r.path == leaf)
    chunk = record.storage.chunk_shape
    count = 1
    for s, c, n in zip(region, chunk, record.shape, strict=True):
        lo, hi, _ = s.indices(n)
        count *= -(-hi // c) - lo // c
    return count * int(np.prod(chunk)) * np.dtype(record.dtype).itemsize


def _check_bytes(read: int, want: int, what: str) -> None:
    assert want <= read <= want * 1.05, (what, read, want, read / want)


@pytest.mark.parametrize("format_version", [1, 2])
def test_sharded_targets_read_only_the_bytes_they_need(tmp_path, format_version):
    """8 CPU devices: a stacked leaf sharded over layers and over rows, a single layer
    unstacked (partial) and one third of a fused QKV read; the bytes read (the kernel's
    rchar, metadata included) are within 5% of the target's bytes."""
    tree = _per_layer()
    rng = np.random.default_rng(2)
    tree["qkv"] = rng.standard_normal((ROWS, 3 * COLS), dtype=np.float32)
    stacked = {"w": np.stack([tree[f"layers_{i}"]["w"] for i in range(N)]), "qkv": tree["qkv"]}
    fop.save(tmp_path / "per", tree, format_version=format_version)
    fop.save(tmp_path / "stk", stacked, format_version=format_version)
    ops = [fop.Stack("w", "layers_{i}/w")]
    w = stacked["w"]
    for spec, mesh in [(PartitionSpec("a"), (8,)), (PartitionSpec(None, "a", "b"), (4, 2))]:
        like = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=_sharding(spec, mesh))}
        read, out = _read_bytes(
            lambda like=like: fop.restore(tmp_path / "per", like, partial=True, surgery=ops)
        )
        _check_bytes(read, w.nbytes, f"stack {spec}")
        assert out["w"].sharding == like["w"].sharding
        np.testing.assert_array_equal(np.asarray(out["w"]), w)
        shard = out["w"].addressable_shards[3]
        np.testing.assert_array_equal(np.asarray(shard.data), w[shard.index])
    like = {"layers_3": {"w": np.zeros((ROWS, COLS), np.float32)}}
    unstack = [fop.Unstack("w", "layers_{i}/w")]
    read, out = _read_bytes(
        lambda: fop.restore(tmp_path / "stk", like, partial=True, surgery=unstack)
    )
    # the saved chunks it covers (a stacked leaf of 4 MiB is one chunk: read whole)
    need = _chunk_bytes(tmp_path / "stk", "w", (slice(3, 4), slice(None), slice(None)))
    _check_bytes(read, need, "one layer unstacked")
    np.testing.assert_array_equal(out["layers_3"]["w"], w[3])
    k_like = jax.ShapeDtypeStruct(
        (ROWS, COLS), np.float32, sharding=_sharding(PartitionSpec(None, "a"))
    )
    split = [fop.Split("qkv", ["q", "k", "v"], axis=1)]
    read, out = _read_bytes(
        lambda: fop.restore(tmp_path / "stk", {"k": k_like}, partial=True, surgery=split)
    )
    need = _chunk_bytes(tmp_path / "stk", "qkv", (slice(None), slice(COLS, 2 * COLS)))
    _check_bytes(read, need, "k of qkv")
    np.testing.assert_array_equal(np.asarray(out["k"]), tree["qkv"][:, COLS : 2 * COLS])


@pytest.mark.parametrize("format_version", [1, 2])
def test_s3_sharded_stack_and_split_read_only_needed_bytes(s3_location, format_version):
    """The S3 test server: a sharded stack reads the target's bytes (tensorstore's S3
    byte counter; the JSON metadata, counted by reading it alone, set apart); half a
    layer reads no more than a plain restore of that layer (the chunk it lies in, and
    what the format reads around it)."""
    tree = _per_layer()
    url = f"{s3_location.url}/v{format_version}"
    fop.save(url, tree, format_version=format_version)
    before = _s3_bytes()
    fop.metadata(url)
    meta = _s3_bytes() - before
    w = np.stack([tree[f"layers_{i}"]["w"] for i in range(N)])
    like = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=_sharding(PartitionSpec("a")))}
    before = _s3_bytes()
    out = fop.restore(url, like, partial=True, surgery=[fop.Stack("w", "layers_{i}/w")])
    read = _s3_bytes() - before - meta
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    assert read > 0, "the S3 counter saw no reads"
    _check_bytes(read, w.nbytes, "s3 stack")
    before = _s3_bytes()
    fop.restore(url, {"layers_2": {"w": np.zeros((ROWS, COLS), np.float32)}}, partial=True)
    plain = _s3_bytes() - before
    like = {"layers_2": {"w": np.zeros((ROWS // 2, COLS), np.float32)}}
    before = _s3_bytes()
    split = [fop.Split("layers_2/w", ["layers_2/w", "rest"], axis=0)]
    out = fop.restore(url, like, partial=True, surgery=split)
    np.testing.assert_array_equal(out["layers_2"]["w"], tree["layers_2"]["w"][: ROWS // 2])
    _check_bytes(_s3_bytes() - before, plain, "s3 half a layer, against a plain restore")


def test_manager_and_restore_params_take_surgery(tmp_path):
    params = {"Dense_0": {"kernel": np.arange(12.0, dtype=np.float32).reshape(3, 4)}}
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": params})
    ops = [fop.Transpose("Dense_0/kernel", (1, 0))]
    like = {"Dense_0": {"kernel": np.zeros((4, 3), np.float32)}}
    got = fop.restore_params(tmp_path / "run", like, surgery=ops)
    np.testing.assert_array_equal(got["Dense_0"]["kernel"], params["Dense_0"]["kernel"].T)
    plan = fop.restore_params(tmp_path / "run", like, surgery=ops, dry_run=True)
    assert plan.entry("Dense_0/kernel").sources == (("Dense_0/kernel", ((0, 3), (0, 4))),)
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        got = mngr.restore({"params": like}, items="params", surgery=ops)
    np.testing.assert_array_equal(got["Dense_0"]["kernel"], params["Dense_0"]["kernel"].T)
    cb = fop.CheckpointCallback(tmp_path / "run", resume=True)
    state = cb.on_train_start({"params": like}, surgery=ops)
    cb.on_train_end(state)
    np.testing.assert_array_equal(
        state["params"]["Dense_0"]["kernel"], params["Dense_0"]["kernel"].T
    )


def test_readme_recipe(tmp_path, capsys):
    """docs/changed_models.md's surgery recipe, as written: a scanned Linen model
    restored into a per-layer NNX model gives the same outputs."""
    from flax import linen, nnx

    class Block(linen.Module):
        @linen.compact
        def __call__(self, x, _):
            return linen.tanh(linen.Dense(8, name="mlp")(x)), None

    class Scanned(linen.Module):
        @linen.compact
        def __call__(self, x):
            scan = linen.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
            )
            return scan(name="layers")(x, None)[0]

    class NNXBlock(nnx.Module):
        def __init__(self, rngs):
            self.mlp = nnx.Linear(8, 8, rngs=rngs)

    class PerLayerModel(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([NNXBlock(rngs) for _ in range(4)])

        def __call__(self, x):
            for block in self.layers:
                x = jax.numpy.tanh(block.mlp(x))
            return x

    x = jax.random.normal(jax.random.key(2), (3, 8))
    linen_params = Scanned().init(jax.random.key(0), x)["params"]
    names = {"fop": fop, "nnx": nnx, "PerLayerModel": PerLayerModel}
    names |= {"linen_params": linen_params, "scanned_directory": str(tmp_path / "scanned")}
    exec(_docs.run_by("tests/like/test_surgery.py::test_readme_recipe"), names)
    model = names["model"]
    assert "layers/2/mlp/kernel/value" in capsys.readouterr().out
    want = Scanned().apply({"params": linen_params}, x)
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(want), rtol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(model.layers[3].mlp.kernel[...]), linen_params["layers"]["mlp"]["kernel"][3]
    )


@pytest.mark.parametrize("format_version", [1, 2])
def test_sub_byte_and_cast_leaves_through_surgery(tmp_path, format_version):
    """int4 leaves (packed, in a batch and in an array of their own) stacked, and a
    float32 leaf transposed then cast to like's bfloat16, equal numpy's."""
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    tree = {
        f"l_{i}": {
            "q": rng.integers(-8, 8, (4, 6)).astype(jnp.int4),
            "big": rng.integers(-8, 8, (1024, 2048)).astype(jnp.int4),
            "f": rng.standard_normal((3, 5)).astype(np.float32),
        }
        for i in range(3)
    }
    fop.save(tmp_path / "c", tree, format_version=format_version)
    like = {
        "s": {
            "q": np.zeros((3, 4, 6), jnp.int4),
            "big": np.zeros((3, 1024, 2048), jnp.int4),
            "f": jax.ShapeDtypeStruct((5, 3, 3), jnp.bfloat16),
        }
    }
    ops = [fop.Stack("s/", "l_{i}/"), fop.Transpose("s/f", (2, 0, 1))]
    out = fop.restore(tmp_path / "c", like, surgery=ops)
    for key in ("q", "big"):
        want = np.stack([tree[f"l_{i}"][key] for i in range(3)])
        assert np.asarray(out["s"][key]).tobytes() == want.tobytes(), key
    want = np.stack([tree[f"l_{i}"]["f"] for i in range(3)]).transpose(2, 0, 1)
    assert out["s"]["f"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["s"]["f"]), want.astype(jnp.bfloat16))
