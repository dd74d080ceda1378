"""_msgpack_import: files written by flax.serialization and flax.training.checkpoints."""

import json
import logging
import os

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import serialization
from flax.training import checkpoints, train_state

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._errors import CorruptCheckpointError, StructureError
from flax_orbax_plugin._format import foreign as _foreign
from flax_orbax_plugin._interop import importing as _importing
from flax_orbax_plugin._interop import msgpack_reader as _msgpack_import


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def _state(step):
    net = Net()
    params = net.init(jax.random.key(step), jnp.zeros((1, 5)))["params"]
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16) if p.ndim == 1 else p, params)
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-3))
    return state.replace(step=step)


def _leaves(tree):
    return [
        ("/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in p), v)
        for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _assert_bit_exact(got, want):
    got, want = _leaves(got), _leaves(want)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, g), (_, w) in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), path


def test_to_bytes_file_read_bit_exact_without_flax(tmp_path):
    state = _state(3)
    path = tmp_path / "state.msgpack"
    path.write_bytes(serialization.to_bytes(state))
    assert _foreign.is_msgpack_checkpoint(path)
    tree = _msgpack_import.read_msgpack(path)
    assert sorted(tree) == ["opt_state", "params", "step"]
    _assert_bit_exact(tree["params"], state.params)
    assert tree["params"]["Dense_0"]["bias"].dtype == ml_dtypes.bfloat16
    # with a template: shapes checked, lossless dtypes only
    like = jax.eval_shape(lambda: state.params)
    _assert_bit_exact(
        _msgpack_import.restore_msgpack(path, {"params": like}, partial=True),
        {"params": state.params},
    )
    like["Dense_0"]["kernel"] = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    with pytest.raises(StructureError, match=r"params/Dense_0/kernel.*\(8, 4\).*\(8, 3\)"):
        _msgpack_import.restore_msgpack(path, {"params": like}, partial=True)


def test_import_to_bytes_file_as_a_step(tmp_path, capsys):
    state = _state(12)
    path = tmp_path / "state.msgpack"
    path.write_bytes(serialization.to_bytes(state))
    out = tmp_path / "ckpts"
    rc = cli.main(["import", str(path), str(out), "--step", "12"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    _assert_bit_exact(fop.restore_params(out), state.params)
    # the whole TrainState comes back through the manager, optax types included
    with fop.CheckpointManager(out, read_only=True) as mngr:
        assert mngr.steps() == [12]
        restored = mngr.restore(like=_state(0))
    assert int(restored.step) == 12
    _assert_bit_exact(restored.opt_state, state.opt_state)
    assert isinstance(restored.opt_state[0], optax.ScaleByAdamState)


def test_flax_training_checkpoints_directory(tmp_path):
    flax.config.update("flax_use_orbax_checkpointing", False)
    try:
        ckpt_dir = tmp_path / "flax_ckpts"
        states = {}
        for step in (100, 200):
            states[step] = _state(step)
            checkpoints.save_checkpoint(str(ckpt_dir), states[step], step, keep=5)
    finally:
        flax.config.update("flax_use_orbax_checkpointing", True)
    assert sorted(os.listdir(ckpt_dir)) == ["checkpoint_100", "checkpoint_200"]
    out = tmp_path / "ours"
    assert _importing.import_msgpack(ckpt_dir, out) == [100, 200]
    for step in (100, 200):
        _assert_bit_exact(fop.restore_params(out, step=step), states[step].params)
    # only one step, into another directory; an existing step needs force
    other = tmp_path / "one"
    assert _importing.import_msgpack(ckpt_dir, other, step=200) == [200]
    with pytest.raises(FileExistsError, match="step 200 exists"):
        _importing.import_msgpack(ckpt_dir, other, step=200)
    assert _importing.import_msgpack(ckpt_dir, other, step=200, force=True) == [200]


def test_a_plain_params_tree_becomes_params_and_chunked_arrays_join(tmp_path, monkeypatch):
    """A tree without 'params' is imported as params; an array larger than flax's
    chunk limit (lowered here) is stored chunked and read back whole."""
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 64)
    tree = {"w": np.arange(100, dtype=np.float32).reshape(10, 10), "b": np.float32(2.5)}
    path = tmp_path / "plain.msgpack"
    path.write_bytes(serialization.msgpack_serialize(tree))
    raw = msgpack.unpackb(path.read_bytes(), strict_map_key=False, ext_hook=lambda c, d: None)
    assert raw["w"]["__msgpack_chunked_array__"] is True
    out = tmp_path / "ckpts"
    with pytest.raises(StructureError, match=r"plain.msgpack: no step to import it as.*step="):
        _importing.import_msgpack(path, out)  # no step leaf, no number in the name
    assert not out.exists()
    assert _importing.import_msgpack(path, out, step=0) == [0]
    got = fop.restore_params(out)
    np.testing.assert_array_equal(got["w"], tree["w"])
    assert got["b"] == np.float32(2.5)


def test_malformed_files_are_clear_errors(tmp_path):
    bad_dtype = tmp_path / "object.msgpack"
    payload = msgpack.packb(((2,), "object", b"\0" * 16))
    bad_dtype.write_bytes(msgpack.packb({"x": msgpack.ExtType(1, payload)}))
    with pytest.raises(CorruptCheckpointError, match="dtype 'object'"):
        _msgpack_import.read_msgpack(bad_dtype)
    short = tmp_path / "short.msgpack"
    short.write_bytes(
        msgpack.packb({"x": msgpack.ExtType(1, msgpack.packb(((4,), "float32", b"\0")))})
    )
    with pytest.raises(CorruptCheckpointError, match=r"needs 16 bytes, found 1"):
        _msgpack_import.read_msgpack(short)
    truncated = tmp_path / "truncated.msgpack"
    truncated.write_bytes(serialization.to_bytes({"a": np.ones(100)})[:-10])
    with pytest.raises(CorruptCheckpointError, match="truncated.msgpack"):
        _msgpack_import.read_msgpack(truncated)
    unknown = tmp_path / "ext.msgpack"
    unknown.write_bytes(msgpack.packb({"x": msgpack.ExtType(42, b"")}))
    with pytest.raises(CorruptCheckpointError, match="extension type 42"):
        _msgpack_import.read_msgpack(unknown)
    rc = cli.main(["import", str(tmp_path / "missing"), str(tmp_path / "o")])
    assert rc == cli.EXIT_ERROR


def test_import_writes_format_version_2_steps_on_request(tmp_path, capsys):
    state = _state(7)
    path = tmp_path / "state.msgpack"
    path.write_bytes(serialization.to_bytes(state))
    out = tmp_path / "ckpts"
    rc = cli.main(["import", str(path), str(out), "--step", "7", "--format-version", "2"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    meta = json.loads((out / "7" / "params" / "_METADATA.json").read_text())
    assert meta["format_version"] == 2
    assert (out / "7" / "params" / "data" / "0.json").is_file()
    assert not (out / "7" / "params" / "d").exists()  # no version-1 chunk files
    _assert_bit_exact(fop.restore_params(out), state.params)
    assert all(r.ok for r in fop.verify(out))


@pytest.mark.parametrize("entry", ["cli", "python"])
def test_the_step_comes_from_the_state_and_a_given_one_must_agree(tmp_path, capsys, entry):
    """A TrainState saved at step 7 imports as step 7 (was 0) without a step given; a
    given step that disagrees is refused, naming both, before anything is written."""
    path = tmp_path / "state.msgpack"
    state = _state(7)
    path.write_bytes(serialization.to_bytes(state))

    def run(out, *step):
        if entry == "python":
            kwargs = {"step": int(step[0])} if step else {}
            return _importing.import_msgpack(path, out, **kwargs)
        rc = cli.main(["import", str(path), str(out), *(("--step", *step) if step else ())])
        _, err = capsys.readouterr()
        if rc != 0:
            raise StructureError(err)
        return None

    run(tmp_path / "a")
    with fop.CheckpointManager(tmp_path / "a", read_only=True) as mngr:
        assert mngr.steps() == [7]
        assert int(mngr.restore(like=_state(0)).step) == 7
    run(tmp_path / "b", "7")
    with pytest.raises(StructureError, match=r"state.msgpack: step 3 was asked for.*says 7"):
        run(tmp_path / "c", "3")
    assert not (tmp_path / "c").exists()


def test_a_file_named_for_another_step_than_its_state_imports_as_the_states(tmp_path, caplog):
    ckpt_dir = tmp_path / "flax"
    flax.config.update("flax_use_orbax_checkpointing", False)
    try:
        checkpoints.save_checkpoint(str(ckpt_dir), _state(5), 100, keep=5)
    finally:
        flax.config.update("flax_use_orbax_checkpointing", True)
    out = tmp_path / "ckpts"
    with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
        assert _importing.import_msgpack(ckpt_dir, out) == [5]
    assert "named for step 100 but its state's step leaf says 5" in caplog.text
    with pytest.raises(StructureError, match="step 100 was asked for.*says 5"):
        _importing.import_msgpack(ckpt_dir, tmp_path / "other", step=100)


def test_an_import_never_hides_behind_newer_steps_nor_writes_one_step_twice(tmp_path):
    """Steps of another run newer than those imported are refused (a resume would take
    them); older ones are kept beside with a warning; two files giving one step are
    refused at the second, never replaced one by the other."""
    (tmp_path / "s.msgpack").write_bytes(serialization.to_bytes(_state(5)))
    run = tmp_path / "run"
    with fop.CheckpointManager(run, async_save=False) as m:
        m.save(10, {"params": {"w": np.ones(2)}})
    with pytest.raises(FileExistsError, match=r"newer than those imported \(10\)"):
        fop.import_msgpack(tmp_path / "s.msgpack", run, step=5)
    (tmp_path / "s11.msgpack").write_bytes(serialization.to_bytes(_state(11)))
    with pytest.warns(UserWarning, match="already holds steps 10"):
        fop.import_msgpack(tmp_path / "s11.msgpack", run, step=11)
    twice = tmp_path / "twice"
    twice.mkdir()
    for name in ("checkpoint_1", "checkpoint_2"):  # both hold the state of step 0
        (twice / name).write_bytes(serialization.to_bytes(_state(0)))
    with pytest.raises(StructureError, match="two checkpoints of this import give step 0"):
        fop.import_msgpack(twice, tmp_path / "out")


def test_flax_training_checkpoints_orbax_directories_point_at_the_orbax_readers(tmp_path):
    """flax.training.checkpoints writes Orbax directories (checkpoint_<step>/) today:
    the msgpack readers said 'no checkpoint_<step> files' and 'a directory, not a
    msgpack file', pointing nowhere; import_orbax reads them."""
    from flax.training import checkpoints

    checkpoints.save_checkpoint(tmp_path / "ck", {"params": {"w": np.ones(3)}}, step=9)
    with pytest.raises(fop.CheckpointNotFoundError, match=r"holds Orbax checkpoints.*import_orbax"):
        fop.import_msgpack(tmp_path / "ck", tmp_path / "out")
    with pytest.raises(fop.CheckpointNotFoundError, match=r"Orbax checkpoints.*restore_params"):
        fop.restore_msgpack(tmp_path / "ck" / "checkpoint_9")
    assert fop.import_orbax(tmp_path / "ck", tmp_path / "out") == [9]


def test_none_and_empty_entries_of_a_state_round_trip(tmp_path):
    """Top-level None and {} entries of a state with params are imported as items
    (this library's save keeps them), never dropped without a word."""
    state = {"params": {"w": np.ones(2, np.float32)}, "nothing": None, "e": {}, "step": 4}
    with open(tmp_path / "checkpoint_4", "wb") as f:
        f.write(serialization.msgpack_serialize(state))
    assert fop.import_msgpack(tmp_path / "checkpoint_4", tmp_path / "out") == [4]
    with fop.CheckpointManager(tmp_path / "out", read_only=True) as mngr:
        got = mngr.restore()
    assert got["nothing"] is None and got["e"] == {} and got["step"] == 4
    np.testing.assert_array_equal(got["params"]["w"], np.ones(2, np.float32))
