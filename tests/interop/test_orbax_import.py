"""_orbax_import: checkpoints written by orbax-checkpoint itself, read without orbax."""

import json
import os
import subprocess
import sys

import _paths
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._errors import CorruptCheckpointError, StructureError
from flax_orbax_plugin._format import foreign as _foreign
from flax_orbax_plugin._interop import importing as _importing
from flax_orbax_plugin._interop import orbax_reader as _orbax_import

REPO = _paths.REPO


def _params(seed):
    rng = np.random.default_rng(seed)
    return {
        "Dense_0": {
            "kernel": rng.standard_normal((16, 8), dtype=np.float32),
            "bias": rng.standard_normal(8, dtype=np.float32).astype(ml_dtypes.bfloat16),
        },
        "Embed_0": {"embedding": rng.standard_normal((6, 16)).astype(np.float16)},
    }


def _state(seed, step):
    params = _params(seed)
    opt_state = optax.adam(1e-3).init(params)
    opt_state = jax.tree.map(lambda x: x + np.asarray(seed, x.dtype), opt_state)
    return {"step": step, "params": params, "opt_state": opt_state}


def _flat(tree):
    """(path, leaf) pairs; dict keys, attributes and indices alike ('0/mu/w')."""
    return [
        ("/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in p), v)
        for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _assert_bit_exact(got, want):
    got_flat, want_flat = _flat(got), _flat(want)
    assert [p for p, _ in got_flat] == [p for p, _ in want_flat]
    for (path, g), (_, w) in zip(got_flat, want_flat, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, path
        assert g.tobytes() == w.tobytes(), path


@pytest.fixture(scope="module")
def standard_dir(tmp_path_factory):
    """A lone StandardSave of a training-state dict (numpy, bfloat16, float16, optax)."""
    path = tmp_path_factory.mktemp("orbax") / "standard"
    state = _state(1, 7)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, state)
        ckptr.wait_until_finished()
    return path, state


@pytest.fixture(scope="module")
def manager_dir(tmp_path_factory, devices):
    """An orbax CheckpointManager directory: steps 10, 20, 30, each a Composite of a
    StandardSave pytree (with a 2x4-sharded kernel) and a JsonSave item."""
    path = tmp_path_factory.mktemp("orbax") / "run"
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    states = {}
    with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=5)) as mngr:
        for step in (10, 20, 30):
            state = _state(step, step)
            state["params"]["Dense_0"]["kernel"] = jax.device_put(
                state["params"]["Dense_0"]["kernel"], sharding
            )
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    meta=ocp.args.JsonSave({"loss": 1.0 / step, "note": "orbax"}),
                ),
            )
            states[step] = jax.tree.map(np.asarray, state)
        mngr.wait_until_finished()
    return path, states


def test_recognizes_orbax_and_not_ours(standard_dir, manager_dir, tmp_path):
    assert _foreign.is_orbax_checkpoint(standard_dir[0])
    assert _foreign.is_orbax_checkpoint(manager_dir[0])
    assert _foreign.is_orbax_checkpoint(manager_dir[0] / "20")
    assert _orbax_import.orbax_steps(manager_dir[0]) == [10, 20, 30]
    fop.save(tmp_path / "ours", {"a": np.ones(3)})
    with fop.CheckpointManager(tmp_path / "mine") as mngr:
        mngr.save(1, {"params": {"a": np.ones(2)}})
    assert not _foreign.is_orbax_checkpoint(tmp_path / "ours")
    assert not _foreign.is_orbax_checkpoint(tmp_path / "mine")
    assert not _foreign.is_orbax_checkpoint(tmp_path / "missing")


def test_standard_save_restored_bit_exact(standard_dir):
    path, state = standard_dir
    got = fop.restore(path)
    assert got["step"] == 7 and isinstance(got["step"], int)
    _assert_bit_exact(got["params"], state["params"])
    assert got["opt_state"][0]["mu"]["Dense_0"]["bias"].dtype == ml_dtypes.bfloat16
    # with a like template: the optax state comes back as optax's own NamedTuples
    like = jax.eval_shape(lambda: state)
    got = fop.restore(path, like)
    assert int(got.pop("step")) == 7  # a Python int in like's dtype (eval_shape: int32)
    _assert_bit_exact(got, {k: state[k] for k in ("params", "opt_state")})
    assert isinstance(got["opt_state"][0], optax.ScaleByAdamState)
    assert isinstance(got["params"]["Dense_0"]["kernel"], jax.Array)


def test_like_checks_shapes_and_refuses_lossy_casts(standard_dir):
    path, state = standard_dir
    like = jax.eval_shape(lambda: state["params"])
    like["Dense_0"]["kernel"] = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    with pytest.raises(StructureError, match=r"Dense_0/kernel.*\(8, 16\).*\(16, 8\)"):
        fop.restore(path, {"params": like}, partial=True)
    like["Dense_0"]["kernel"] = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16)  # float32 -> bf16
    with pytest.raises(StructureError, match=r"Dense_0/kernel.*bfloat16.*float32.*changes values"):
        fop.restore(path, {"params": like}, partial=True)
    # widening is lossless: float16 -> float32 is allowed
    like["Dense_0"]["kernel"] = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    like["Embed_0"]["embedding"] = jax.ShapeDtypeStruct((6, 16), jnp.float32)
    got = fop.restore(path, {"params": like}, partial=True)
    np.testing.assert_array_equal(
        got["params"]["Embed_0"]["embedding"],
        state["params"]["Embed_0"]["embedding"].astype(np.float32),
    )
    with pytest.raises(StructureError, match="unexpected key"):
        fop.restore(path, {"params": like})  # not partial: opt_state, step are left over
    with pytest.raises(StructureError, match="no such key"):
        fop.restore(path, {"params": {"nope": jax.ShapeDtypeStruct((1,), jnp.float32)}})


def test_manager_composite_and_sharded_restore(manager_dir, devices):
    path, states = manager_dir
    got = fop.restore(path)  # latest step: {item: tree}
    assert sorted(got) == ["meta", "state"]
    assert got["meta"] == {"loss": 1.0 / 30, "note": "orbax"}
    _assert_bit_exact(got["state"]["params"], states[30]["params"])
    got20 = _orbax_import.restore_orbax(path, step=20)
    _assert_bit_exact(got20["state"]["opt_state"], states[20]["opt_state"])

    # onto another mesh: every device holds exactly its region of the saved array
    mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
    sharding = NamedSharding(mesh, P("b", "a"))
    like = jax.eval_shape(lambda: states[30]["params"])
    like["Dense_0"]["kernel"] = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=sharding)
    params = fop.restore_params(path, like)
    kernel = params["Dense_0"]["kernel"]
    assert kernel.sharding == sharding
    want = states[30]["params"]["Dense_0"]["kernel"]
    for shard in kernel.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    _assert_bit_exact(params, states[30]["params"])
    # restore_params: an older step, and a dtype cast asked for explicitly
    old = fop.restore_params(path, step=10, dtype=jnp.bfloat16)
    assert old["Dense_0"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(old["Dense_0"]["kernel"]),
        states[10]["params"]["Dense_0"]["kernel"].astype(ml_dtypes.bfloat16),
    )


@pytest.mark.parametrize("options", [{"use_zarr3": True}, {"use_ocdbt": False}])
def test_zarr3_and_plain_directory_layouts(tmp_path, options):
    """PyTreeSave with zarr3 arrays, and without OCDBT (one directory per leaf);
    strings, None, empty containers, Python scalars and a PRNG key."""
    tree = {
        "w": np.arange(12, dtype=np.int16).reshape(3, 4),
        "name": "run-1",
        "nothing": None,
        "empty": {},
        "lr": 0.25,
        "flag": True,
        "key": jax.random.key(3),
        "layers": [np.ones(2, np.float32), np.zeros((), np.uint8)],
    }
    path = tmp_path / "ckpt"
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**options)) as ckptr:
        ckptr.save(path, args=ocp.args.PyTreeSave(tree))
    got = fop.restore(path)
    assert got["name"] == "run-1" and got["nothing"] is None and got["empty"] == {}
    assert got["lr"] == 0.25 and got["flag"] is True
    np.testing.assert_array_equal(got["w"], tree["w"])
    assert got["w"].dtype == np.int16
    np.testing.assert_array_equal(got["key"], jax.random.key_data(tree["key"]))
    assert [np.asarray(x).dtype for x in got["layers"]] == [np.float32, np.uint8]
    # like with a key array: the key comes back as a key
    like = dict(tree, key=jax.random.key(0))
    restored = fop.restore(path, like)
    assert (
        jax.random.key_data(restored["key"]).tolist() == jax.random.key_data(tree["key"]).tolist()
    )
    assert isinstance(restored["layers"][1], np.ndarray)


def test_damaged_chunk_and_malformed_metadata_are_clear_errors(standard_dir, tmp_path):
    import shutil

    path = tmp_path / "damaged"
    shutil.copytree(standard_dir[0], path)
    # missing data files: the leaf is reported, never zeros
    data_files = [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if os.path.basename(d) == "d"
    ]
    assert data_files
    for f in data_files:
        os.remove(f)
    with pytest.raises(CorruptCheckpointError, match="leaf '.*'"):
        fop.restore(path)
    bad = tmp_path / "bad"
    shutil.copytree(standard_dir[0], bad)
    (bad / "_METADATA").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="_METADATA: not valid JSON"):
        fop.restore(bad)
    (bad / "_METADATA").write_text(json.dumps({"tree_metadata": {"x": {"key_metadata": 3}}}))
    with pytest.raises(CorruptCheckpointError, match="key_metadata"):
        fop.restore(bad)
    # a plain-directory checkpoint may not name storage outside itself
    (bad / "_METADATA").write_text(
        json.dumps(
            {
                "use_ocdbt": False,
                "tree_metadata": {
                    "('..',)": {
                        "key_metadata": [{"key": "..", "key_type": 2}],
                        "value_metadata": {"value_type": "np.ndarray"},
                    }
                },
            }
        )
    )
    with pytest.raises(CorruptCheckpointError, match="not a plain directory name"):
        fop.restore(bad)


def test_cli_import_every_step_then_one(manager_dir, tmp_path, capsys):
    path, states = manager_dir
    out = tmp_path / "imported"
    rc = cli.main(["import", str(path), str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert "10, 20, 30" in stdout
    with fop.CheckpointManager(out, read_only=True) as mngr:
        assert mngr.steps() == [10, 20, 30]
    for step in (10, 20, 30):
        _assert_bit_exact(fop.restore_params(out, step=step), states[step]["params"])
        _assert_bit_exact(
            fop.restore(out / str(step) / "opt_state"),
            states[step]["opt_state"],
        )
    assert json.loads((out / "30" / "step" / "value.json").read_text()) == 30
    assert "orbax" in (out / "30" / "extras" / "value.json").read_text()
    # an existing step is refused without --force, replaced with it
    rc = cli.main(["import", str(path), str(out), "--step", "20"])
    _, err = capsys.readouterr()
    assert rc == cli.EXIT_ERROR and "step 20 exists" in err
    assert cli.main(["import", str(path), str(out), "--step", "20", "--force"]) == 0


def test_import_lone_item_as_given_step(standard_dir, tmp_path):
    """A lone item's training state says step 7: imported as 7 with no step given
    (was 0), and a given step that disagrees is refused before anything is written."""
    path, state = standard_dir
    with pytest.raises(StructureError, match=r"standard: step 5 was asked for.*says 7"):
        _importing.import_orbax(path, tmp_path / "refused", step=5)
    assert not (tmp_path / "refused" / "5").exists()
    out = tmp_path / "one"
    assert _importing.import_orbax(path, out) == [7]
    assert _importing.import_orbax(path, tmp_path / "two", step=7) == [7]
    _assert_bit_exact(fop.restore_params(out), state["params"])
    assert fop.restore(out / "7" / "opt_state") is not None


def test_reading_does_not_import_orbax(standard_dir):
    """The reader is tensorstore alone: orbax is never imported."""
    code = (
        "import sys, flax_orbax_plugin as fop\n"
        f"tree = fop.restore({str(standard_dir[0])!r})\n"
        "assert tree['step'] == 7\n"
        "print(sorted(m for m in sys.modules if m.startswith('orbax')))\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_flax_training_checkpoints_default_writes_orbax(tmp_path):
    """flax.training.checkpoints (orbax on, its default) names steps checkpoint_<N>."""
    from flax.training import checkpoints

    directory = tmp_path / "flax_run"
    states = {s: _state(s, s) for s in (5, 6)}
    for step, state in states.items():
        checkpoints.save_checkpoint(str(directory), state, step, keep=3)
    assert sorted(os.listdir(directory)) == ["checkpoint_5", "checkpoint_6"]
    assert _orbax_import.orbax_steps(directory) == [5, 6]
    _assert_bit_exact(fop.restore_params(directory), states[6]["params"])
    _assert_bit_exact(fop.restore_params(directory, step=5), states[5]["params"])
    out = tmp_path / "ours"
    assert cli.main(["import", str(directory), str(out)]) == 0
    _assert_bit_exact(fop.restore_params(out, step=5), states[5]["params"])
    assert json.loads((out / "6" / "step" / "value.json").read_text()) == 6


def test_a_symbolic_link_inside_is_refused(standard_dir, tmp_path):
    import shutil

    path = tmp_path / "linked"
    shutil.copytree(standard_dir[0], path)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.rename(path / "d", outside / "d")
    os.symlink(outside / "d", path / "d")
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):
        fop.restore(path)
