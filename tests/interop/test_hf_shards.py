"""fop.HFShards: Hugging Face safetensors shards written into a manager's steps.

Read back by the real ``safetensors`` readers (and by ``transformers`` when it is
installed), on local disk and on the S3 server; sharded over 8 CPU devices, each
region written once at its offset."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load, load_file

import flax_orbax_plugin as fop
from flax_orbax_plugin._storage.location import Location

pytest_plugins = ["_servers"]

D, HEADS, VOCAB, POSITIONS, LAYERS = 8, 2, 50, 16, 2
CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": VOCAB,
    "n_positions": POSITIONS,
    "n_embd": D,
    "n_layer": LAYERS,
    "n_head": HEADS,
    "tie_word_embeddings": True,
}


def gpt2_params(seed=0):
    """A GPT-2-shaped Linen param tree (nn.Dense kernels are (in, out))."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    def block():
        return {
            "ln_1": {"scale": 1 + w(D), "bias": w(D)},
            "attn": {
                "c_attn": {"kernel": w(D, 3 * D), "bias": w(3 * D)},
                "c_proj": {"kernel": w(D, D), "bias": w(D)},
            },
            "ln_2": {"scale": 1 + w(D), "bias": w(D)},
            "mlp": {
                "c_fc": {"kernel": w(D, 4 * D), "bias": w(4 * D)},
                "c_proj": {"kernel": w(4 * D, D), "bias": w(D)},
            },
        }

    tree = {"wte": {"embedding": w(VOCAB, D)}, "wpe": {"embedding": w(POSITIONS, D)}}
    tree.update({f"h_{i}": block() for i in range(LAYERS)})
    tree["ln_f"] = {"scale": 1 + w(D), "bias": w(D)}
    return tree


def hf_names(params):
    """The tensors the GPT-2 map must write, by hand: {HF name: array}."""
    out = {
        "transformer.wte.weight": params["wte"]["embedding"],
        "transformer.wpe.weight": params["wpe"]["embedding"],
        "transformer.ln_f.weight": params["ln_f"]["scale"],
        "transformer.ln_f.bias": params["ln_f"]["bias"],
    }
    for i in range(LAYERS):
        b, h = params[f"h_{i}"], f"transformer.h.{i}"
        for ln in ("ln_1", "ln_2"):
            out[f"{h}.{ln}.weight"], out[f"{h}.{ln}.bias"] = b[ln]["scale"], b[ln]["bias"]
        for mod, sub in (
            ("attn", "c_attn"),
            ("attn", "c_proj"),
            ("mlp", "c_fc"),
            ("mlp", "c_proj"),
        ):
            out[f"{h}.{mod}.{sub}.weight"] = b[mod][sub]["kernel"]
            out[f"{h}.{mod}.{sub}.bias"] = b[mod][sub]["bias"]
    return {k: np.asarray(v) for k, v in out.items()}


def read_set(directory):
    """Every tensor of a committed shard set through the safetensors library, and its index."""
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(os.path.join(directory, name)))
    return index, tensors


def test_gpt2_shards_in_every_second_step_committed_and_retained_with_it(tmp_path):
    params = gpt2_params()
    hf = fop.HFShards(every_steps=2, key_map="gpt2", max_shard_bytes=4000, config=CONFIG)
    with fop.CheckpointManager(tmp_path, keep=2, hf_shards=hf) as mngr:
        for step in range(4):
            mngr.save(step, {"params": jax.tree.map(jnp.asarray, params)})
            mngr.wait()
            if step == 2:
                index, tensors = read_set(tmp_path / "2" / "hf")
        assert mngr.steps() == [2, 3]
        assert not (tmp_path / "3" / "hf").exists()  # 3 is no multiple of 2
        restored = mngr.restore(step=2)  # the default restore leaves the copy out
        assert sorted(restored) == ["params"]
        as_item = mngr.restore(step=2, items="hf")
        mngr.save(4, {"params": params})
        mngr.wait()
        assert mngr.steps() == [3, 4]
    assert not (tmp_path / "2").exists()  # retention took step 2 with its shards
    by_path = fop.restore(tmp_path / "4" / "hf")  # the item on its own: {name: array}
    np.testing.assert_array_equal(by_path["transformer.wte.weight"], params["wte"]["embedding"])
    with fop.CheckpointManager(tmp_path, read_only=True, hf_shards=hf) as reader:
        assert sorted(reader.restore(items="hf")) == sorted(hf_names(params))
    assert (tmp_path / "4" / "hf" / "config.json").is_file()

    want = hf_names(params)
    assert sorted(tensors) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
        np.testing.assert_array_equal(as_item[name], value, err_msg=name)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    with safe_open(str(tmp_path / "4" / "hf" / files[0]), "np") as f:
        assert f.metadata()["format"] == "pt"
    assert fop.verify(tmp_path / "4")[0].ok


def test_regex_key_map_transposes_and_unmatched_leaves(tmp_path):
    params = {
        "enc": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "bias": np.ones(4)},
        "head": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)},
        "step_count": np.int32(7),
    }
    rules = {r"(\w+)/kernel": r"model.\1.weight", r"(\w+)/bias": r"model.\1.bias"}
    bad = fop.HFShards(every_steps=1, key_map=rules)
    with fop.CheckpointManager(tmp_path / "bad", hf_shards=bad) as mngr:
        with pytest.raises(fop.StructureError, match="'step_count'.*None to leave it out"):
            mngr.save(0, {"params": params})
        assert mngr.steps() == []
    hf = fop.HFShards(
        every_steps=1,
        key_map={**rules, "step_count": None},
        transposes=[r"head/kernel"],
        dtype="bfloat16",
    )
    with fop.CheckpointManager(tmp_path / "ok", hf_shards=hf) as mngr:
        mngr.save(0, {"params": params})
    _, tensors = read_set(tmp_path / "ok" / "0" / "hf")
    assert sorted(tensors) == ["model.enc.bias", "model.enc.weight", "model.head.weight"]
    head = tensors["model.head.weight"]
    assert head.shape == (3, 2) and str(head.dtype) == "bfloat16"
    np.testing.assert_array_equal(head.astype(np.float32), params["head"]["kernel"].T)
    np.testing.assert_array_equal(
        tensors["model.enc.weight"].astype(np.float32), params["enc"]["kernel"]
    )


def test_failed_write_commits_nothing(tmp_path, monkeypatch):
    hf = fop.HFShards(every_steps=2, key_map="gpt2", max_shard_bytes=4000)
    params = gpt2_params()
    with fop.CheckpointManager(tmp_path, hf_shards=hf, async_save=False) as mngr:
        mngr.save(0, {"params": params})
        monkeypatch.setenv("FOP_FAIL_AT", "hf_shards_write:3")
        with pytest.raises(OSError, match="injected fault at hf_shards_write"):
            mngr.save(2, {"params": params})
        monkeypatch.delenv("FOP_FAIL_AT")
        assert mngr.steps() == [0]
        mngr.save(4, {"params": params})
        assert mngr.steps() == [0, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["0", "4"]
    np.testing.assert_array_equal(
        read_set(tmp_path / "4" / "hf")[1]["transformer.wpe.weight"], params["wpe"]["embedding"]
    )


def test_sharded_arrays_each_region_written_once_at_its_offset(tmp_path, devices):
    mesh = Mesh(np.array(devices).reshape(4, 2), ("x", "y"))
    rng = np.random.default_rng(1)
    full = {
        "rows": rng.standard_normal((16, 6)).astype(np.float32),  # rows over x, replicated on y
        "cols": rng.standard_normal((5, 8)).astype(np.float32),  # columns over y
        "both": rng.standard_normal((8, 4, 3)).astype(np.float32),  # x and y
        "flip": rng.standard_normal((12, 10)).astype(np.float32),  # transposed, rows over x
        "vec": rng.standard_normal(8).astype(np.float32),  # over x, replicated on y
    }
    specs = {
        "rows": P("x"),
        "cols": P(None, "y"),
        "both": P("x", "y"),
        "flip": P("x"),
        "vec": P("x"),
    }
    tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in full.items()}
    hf = fop.HFShards(every_steps=1, transposes=[r"flip"], max_shard_bytes=600)
    pending = hf.save(Location.from_path(tmp_path / "direct"), tree)
    written = pending.wait()
    want = {**full, "flip": full["flip"].T}
    assert written.bytes_written == sum(v.nbytes for v in want.values())  # no region twice
    _, tensors = read_set(tmp_path / "direct")
    for name, value in want.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)

    with fop.CheckpointManager(tmp_path / "run", hf_shards=hf) as mngr:
        mngr.save(1, {"params": tree})
    _, tensors = read_set(tmp_path / "run" / "1" / "hf")
    for name, value in want.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


def test_s3_single_process_files_written_whole(s3_location):
    params = gpt2_params(3)
    hf = fop.HFShards(every_steps=1, key_map="gpt2", max_shard_bytes=4000)
    with fop.CheckpointManager(s3_location.url, hf_shards=hf) as mngr:
        mngr.save(1, {"params": params})
        mngr.wait()
        with pytest.raises(fop.UnsupportedLocationError, match="local disk only"):
            mngr.restore(items="hf")
        assert sorted(mngr.restore()) == ["params"]
    where = Location.from_path(s3_location.url).child("1").child("hf")
    index = json.loads(where.read_bytes("model.safetensors.index.json"))
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load(where.read_bytes(name)))
    want = hf_names(params)
    assert sorted(tensors) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="every_steps=.*found int 0"):
        fop.HFShards(every_steps=0)
    with pytest.raises(ValueError, match="key_map: expected one of \\['gpt2'\\]"):
        fop.HFShards(every_steps=1, key_map="llama9")
    with pytest.raises(ValueError, match="transposes: '\\(' is no regular expression"):
        fop.HFShards(every_steps=1, transposes=["("])
    with pytest.raises(fop.OptionTypeError, match="hf_shards"):
        fop.CheckpointManager("/tmp/never-made", hf_shards=3)


def _numpy_gpt2_logits(params, ids):
    """GPT-2's forward pass in numpy (layer norm eps 1e-5, tanh GELU, tied head)."""

    def ln(x, p):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(v + 1e-5) * p["scale"] + p["bias"]

    def dense(x, p):
        return x @ p["kernel"] + p["bias"]

    t, hd = len(ids), D // HEADS
    x = params["wte"]["embedding"][ids] + params["wpe"]["embedding"][:t]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(LAYERS):
        b = params[f"h_{i}"]
        q, k, v = np.split(dense(ln(x, b["ln_1"]), b["attn"]["c_attn"]), 3, axis=-1)
        q, k, v = (a.reshape(t, HEADS, hd).transpose(1, 0, 2) for a in (q, k, v))
        att = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ v).transpose(1, 0, 2).reshape(t, D)
        x = x + dense(y, b["attn"]["c_proj"])
        h = dense(ln(x, b["ln_2"]), b["mlp"]["c_fc"])
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
        x = x + dense(h, b["mlp"]["c_proj"])
    return ln(x, params["ln_f"]) @ params["wte"]["embedding"].T


def test_from_pretrained_gives_the_same_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    params = gpt2_params(5)
    hf = fop.HFShards(every_steps=1, key_map="gpt2", max_shard_bytes=4000, config=CONFIG)
    with fop.CheckpointManager(tmp_path, hf_shards=hf) as mngr:
        mngr.save(1, {"params": params})
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "1" / "hf")).eval()
    ids = np.array([3, 14, 15, 9, 26, 5])
    with torch.no_grad():
        logits = model(torch.tensor(ids[None])).logits[0].numpy()
    np.testing.assert_allclose(logits, _numpy_gpt2_logits(params, ids), rtol=1e-4, atol=1e-4)


def test_readme_recipe(tmp_path):
    """docs/safetensors.md's "Shards while training" block, run as written."""

    import _docs
    import optax
    import safetensors.numpy
    from flax.training import train_state

    transformers = pytest.importorskip("transformers")
    code = _docs.run_by("tests/interop/test_hf_shards.py::test_readme_recipe")
    params = gpt2_params(7)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    names = {"fop": fop, "transformers": transformers, "safetensors": safetensors}
    names.update(directory=str(tmp_path), config=CONFIG, num_steps=2001, batch=None, state=state)
    names["train_step"] = lambda state, batch: state  # the recipe is about the saves
    exec(compile(code, "docs/safetensors.md", "exec"), names)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == [
        "1000",
        "1500",
        "2000",
    ]
    assert not (tmp_path / "1000" / "hf").exists()
    assert names["model"].transformer.h[1].attn.c_attn.weight.shape == (D, 3 * D)
    for name, value in hf_names(params).items():
        np.testing.assert_array_equal(names["tensors"][name], value, err_msg=name)


def test_runs_place_a_region_where_row_major_order_puts_it():
    """The byte ranges a process writes of a region it holds (what several processes
    write when their regions are not whole rows), against numpy's own indexing."""
    from flax_orbax_plugin._interop.safetensors.headers import runs

    shape = (4, 6, 5)
    for box in [
        (slice(1, 3), slice(0, 6), slice(0, 5)),  # whole trailing axes: one run
        (slice(0, 4), slice(2, 5), slice(0, 5)),  # a middle block
        (slice(1, 2), slice(1, 4), slice(2, 4)),  # a block inside every axis
        (slice(0, 4), slice(0, 6), slice(0, 5)),  # everything
        (slice(2, 2), slice(0, 6), slice(0, 5)),  # empty
    ]:
        region = np.arange(1, 1 + int(np.prod([s.stop - s.start for s in box])))
        flat, pos = np.zeros(int(np.prod(shape)), np.int64), 0
        for first, count in runs(shape, box):
            flat[first : first + count] = region[pos : pos + count]
            pos += count
        assert pos == region.size
        want = np.zeros(shape, np.int64)
        want[box] = region.reshape([s.stop - s.start for s in box])
        np.testing.assert_array_equal(flat.reshape(shape), want)
    assert list(runs((), ())) == [(0, 1)]
    assert len(list(runs(shape, (slice(0, 4), slice(0, 6), slice(1, 3))))) == 24


@pytest.mark.distributed
def test_two_processes_write_their_own_regions_into_one_set(tmp_path):
    """Two real jax processes (2 devices each, mesh data=2 x model=2): each writes its
    own replica-0 regions (rows, a column block: a run per row, a transposed block)
    into the same files; the set reads back whole."""
    import _hf_shards_workers as W
    from _multiprocess import run_processes

    directory = tmp_path / "run"
    result = run_processes(
        "_hf_shards_workers:save_hf",
        2,
        devices_per_process=2,
        mesh_shape=(2, 2),
        mesh_axes=("data", "model"),
        args={"directory": str(directory)},
        timeout_s=120,
    )
    outs = []
    for proc in result.procs:
        assert proc.record.get("ok"), proc.record.get("traceback") or proc.record
        outs.append(proc.record["result"])
    want = W.full_values()
    want["both"] = want["both"].T
    total = sum(v.nbytes for v in want.values())
    assert [o["written"] for o in outs] == [o["mine"] for o in outs]
    assert sum(o["written"] for o in outs) == total and 0 < outs[1]["written"] < total // 2
    _, tensors = read_set(directory / "1" / "hf")
    assert sorted(tensors) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
