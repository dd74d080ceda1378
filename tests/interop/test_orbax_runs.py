"""Orbax runs as people have them (issue 32): written by orbax-checkpoint itself, with
JSON items (a ``best_fn`` run's ``metrics``, ``JsonSave``, a custom JSON file name), the
small standard items (``ArraySave``, random keys, protos), stray entries beside the
steps and the step names orbax's options give; restored, served and imported."""

import json
import logging
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from google.protobuf import struct_pb2

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StructureError,
)
from flax_orbax_plugin._format import foreign as _foreign
from flax_orbax_plugin._interop import importing as _importing
from flax_orbax_plugin._interop import orbax_reader as _orbax_reader

pytest_plugins = ["_servers"]

READER_LOG = "flax_orbax_plugin._interop"


def _extras(directory, step):
    with fop.CheckpointManager(directory, read_only=True) as mngr:
        return mngr.restore(step=step, items=("extras",))["extras"]


def _params(seed):
    rng = np.random.default_rng(seed)
    return {
        "Dense_0": {"kernel": rng.standard_normal((4, 3), dtype=np.float32)},
        "bias": np.arange(3, dtype=np.float32) + seed,
    }


def _same(got, want):
    got_flat = jax.tree_util.tree_flatten_with_path(got)[0]
    want_flat = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in got_flat] == [p for p, _ in want_flat]
    for (path, g), (_, w) in zip(got_flat, want_flat, strict=True):
        assert np.asarray(g).dtype == np.asarray(w).dtype, path
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=str(path))


@pytest.fixture(scope="module")
def best_run(tmp_path_factory):
    """A CheckpointManager keeping its 2 best steps (best_fn), a JSON ``metrics`` item
    in each, a Composite of a StandardSave and a JsonSave, and custom_metadata."""
    path = tmp_path_factory.mktemp("orbax") / "best"
    options = ocp.CheckpointManagerOptions(
        max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min"
    )
    with ocp.CheckpointManager(path, options=options) as mngr:
        for step, loss in ((1, 0.5), (2, 0.25), (3, 0.75)):
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"params": _params(step), "step": step}),
                    config=ocp.args.JsonSave({"lr": 0.1, "schedule": "cosine"}),
                ),
                metrics={"loss": loss},
                custom_metadata={"commit": f"abc{step}"},
            )
        mngr.wait_until_finished()
    assert sorted(os.listdir(path)) == ["1", "2"]  # step 3 was the worst: deleted
    return path


def test_best_fn_run_restores_with_its_metrics(best_run):
    got = fop.restore(best_run)
    assert sorted(got) == ["config", "metrics", "state"]
    assert got["metrics"] == {"loss": 0.25}
    assert got["config"] == {"lr": 0.1, "schedule": "cosine"}
    _same(got["state"]["params"], _params(2))
    # arrays only: the JSON items may be left out of like without partial=True
    like = {"state": jax.eval_shape(lambda: {"params": _params(2), "step": 2})}
    only = fop.restore(best_run, like)
    assert sorted(only) == ["state"]
    _same(only["state"]["params"], _params(2))
    older = _orbax_reader.restore_orbax(best_run, step=1)
    assert older["metrics"] == {"loss": 0.5}


def test_best_fn_run_is_served_ignoring_its_json_items(best_run):
    _same(fop.restore_params(best_run), _params(2))
    _same(fop.restore_params(best_run, step=1), _params(1))
    like = jax.eval_shape(lambda: _params(1))
    _same(fop.restore_params(best_run, like, step=1), _params(1))


def test_best_fn_run_imports_metrics_and_custom_metadata_as_extras(best_run, tmp_path, capsys):
    out = tmp_path / "ours"
    assert cli.main(["import", str(best_run), str(out)]) == 0
    stdout, _ = capsys.readouterr()
    assert "1, 2" in stdout
    for step, loss in ((1, 0.5), (2, 0.25)):
        extras = _extras(out, step)
        assert extras == {
            "loss": loss,
            "config": {"lr": 0.1, "schedule": "cosine"},
            "custom_metadata": {"commit": f"abc{step}"},
        }
        _same(fop.restore_params(out, step=step), _params(step))
    assert cli.main(["list", str(out)]) == 0
    listing, _ = capsys.readouterr()
    assert "loss=0.25" in listing and "loss=0.5" in listing
    # the imported run keeps its best steps by the same metric
    with fop.CheckpointManager(
        out, keep=1, keep_best=1, best_metric="loss", best_mode="min", async_save=False
    ) as mngr:
        mngr.save(3, {"params": _params(3)}, extras={"loss": 0.9})
        mngr.wait()
        assert mngr.steps() == [2, 3]


def test_a_metric_named_like_a_json_item_is_refused_on_import(tmp_path):
    path = tmp_path / "clash"
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"])
    with ocp.CheckpointManager(path, options=options) as mngr:
        mngr.save(
            1,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_params(1)), loss=ocp.args.JsonSave([0.5])
            ),
            metrics={"loss": 0.5},
        )
        mngr.wait_until_finished()
    assert fop.restore(path)["loss"] == [0.5]  # read as it is
    with pytest.raises(StructureError, match=r"metric 'loss'.*also the name of a JSON item"):
        _importing.import_orbax(path, tmp_path / "out")
    assert not (tmp_path / "out" / "1").exists()


def test_json_items_with_their_own_file_names(tmp_path):
    """JsonCheckpointHandler(filename=...) and orbax v1's training Checkpointer, whose
    metrics item is a MetricsHandler."""
    path = tmp_path / "custom"
    handlers = {
        "state": ocp.StandardCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(filename="config.json"),
    }
    with ocp.CheckpointManager(path, item_handlers=handlers) as mngr:
        mngr.save(
            4,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(_params(4)),
                config=ocp.args.JsonSave({"layers": [1, 2], "clip": float("inf")}),
            ),
        )
        mngr.wait_until_finished()
    assert "config.json" in os.listdir(path / "4" / "config")
    for where in (path, path / "4", path / "4" / "config"):  # copied on a Mac
        (where / ".DS_Store").write_bytes(b"\0")
    got = fop.restore(path)
    assert got["config"] == {"layers": [1, 2], "clip": float("inf")}
    _same(got["state"], _params(4))
    out = tmp_path / "ours"
    assert _importing.import_orbax(path, out) == [4]
    assert _extras(out, 4) == {"config": {"layers": [1, 2], "clip": float("inf")}}

    from orbax.checkpoint import v1 as ocp_v1  # only this test needs orbax's v1 API

    v1_path = tmp_path / "v1"
    with ocp_v1.training.Checkpointer(v1_path) as ckptr:
        ckptr.save(7, _params(7), metrics={"accuracy": 0.75})
    got = fop.restore(v1_path)
    assert got["metrics"] == {"accuracy": 0.75}
    _same(fop.restore_params(v1_path), _params(7))
    assert _importing.import_orbax(v1_path, tmp_path / "v1_ours") == [7]
    assert _extras(tmp_path / "v1_ours", 7) == {"accuracy": 0.75}


@pytest.fixture(scope="module")
def small_items_run(tmp_path_factory):
    """One step holding every standard small item orbax has an argument for."""
    path = tmp_path_factory.mktemp("orbax") / "small"
    proto = struct_pb2.Struct()
    proto.update({"name": "mlp"})
    with ocp.CheckpointManager(path, metadata={"model": "mlp"}) as mngr:
        mngr.save(
            5,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(_params(5)),
                counts=ocp.args.ArraySave(np.arange(4, dtype=np.int32)),
                jax_key=ocp.args.JaxRandomKeySave(jax.random.key(3)),
                np_state=ocp.args.NumpyRandomKeySave(np.random.RandomState(9).get_state()),
                config=ocp.args.ProtoSave(proto),
            ),
        )
        mngr.wait_until_finished()
    assert (path / "metadata").is_dir()  # the run's own metadata: beside the steps
    return path


def test_standard_small_items_restore_and_import(small_items_run, tmp_path):
    got = fop.restore(small_items_run)
    np.testing.assert_array_equal(got["counts"], np.arange(4, dtype=np.int32))
    assert got["counts"].dtype == np.int32
    np.testing.assert_array_equal(got["jax_key"], jax.random.key_data(jax.random.key(3)))
    want_state = np.random.RandomState(9).get_state()
    assert isinstance(got["np_state"], tuple) and got["np_state"][0] == "MT19937"
    np.testing.assert_array_equal(got["np_state"][1], want_state[1])
    assert tuple(got["np_state"][2:]) == tuple(want_state[2:])
    rng = np.random.RandomState()
    rng.set_state(got["np_state"])  # usable as it is
    assert rng.randint(1 << 30) == np.random.RandomState(9).randint(1 << 30)
    assert 'string_value: "mlp"' in got["config"]
    # with like: the key comes back as a key, the array in like's form
    like = {"jax_key": jax.random.key(0), "counts": jax.ShapeDtypeStruct((4,), np.int32)}
    typed = fop.restore(small_items_run, like, partial=True)
    assert jax.random.key_data(typed["jax_key"]).tolist() == got["jax_key"].tolist()
    _same(fop.restore_params(small_items_run), _params(5))
    out = tmp_path / "ours"
    assert _importing.import_orbax(small_items_run, out) == [5]
    np.testing.assert_array_equal(fop.restore(out / "5" / "counts"), np.arange(4))
    assert 'string_value: "mlp"' in _extras(out, 5)["config"]


def test_an_unknown_handler_is_refused_by_name_only_where_read(small_items_run, tmp_path):
    path = tmp_path / "custom"
    shutil.copytree(small_items_run, path)
    record_file = path / "5" / "_CHECKPOINT_METADATA"
    record = json.loads(record_file.read_text())
    record["item_handlers"]["config"] = "my_project.handlers.FancyHandler"
    record_file.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"'config'.*FancyHandler"):
        fop.restore(path)
    with pytest.raises(CheckpointError, match=r"'config'.*FancyHandler"):
        _importing.import_orbax(path, tmp_path / "out")
    _same(fop.restore_params(path), _params(5))
    got = fop.restore(path, {"params": jax.eval_shape(lambda: _params(5))}, partial=True)
    _same(got["params"], _params(5))


# -- stray entries beside the steps ------------------------------------------------------


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """Steps 10 and 20 of a plain CheckpointManager run (one StandardSave item)."""
    path = tmp_path_factory.mktemp("orbax") / "plain"
    with ocp.CheckpointManager(path) as mngr:
        for step in (10, 20):
            mngr.save(step, args=ocp.args.StandardSave(_params(step)))
        mngr.wait_until_finished()
    return path


def _strayed(plain_run, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(plain_run, path)
    (path / "999").mkdir()  # a stray empty folder
    (path / "1000").write_text("not a step\n")  # a file named like a step
    (path / ".DS_Store").write_bytes(b"\0\1")
    (path / ".hidden").mkdir()
    (path / "notes").mkdir()
    shutil.copytree(path / "20", path / "30.orbax-checkpoint-tmp-1796177722")  # unfinished
    return path


def test_stray_entries_are_passed_over_by_every_entry_point(plain_run, tmp_path, caplog):
    path = _strayed(plain_run, tmp_path)
    assert _foreign.is_orbax_checkpoint(path)
    assert _orbax_reader.orbax_steps(path) == [10, 20]
    with caplog.at_level(logging.WARNING, logger=READER_LOG):
        got = fop.restore(path)
    _same(got["default"], _params(20))
    passed = caplog.text
    for name in ("'999' (an empty folder)", "'1000' (a file", "30.orbax-checkpoint-tmp"):
        assert name in passed
    assert "notes" not in passed and ".DS_Store" not in passed
    _same(fop.restore_params(path), _params(20))
    _same(fop.restore_params(path, step=10), _params(10))
    with pytest.raises(CheckpointNotFoundError, match=r"no finalized Orbax step 999.*empty"):
        fop.restore_params(path, step=999)
    out = tmp_path / "ours"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=READER_LOG):
        assert cli.main(["import", str(path), str(out)]) == 0
    assert "'999' (an empty folder)" in caplog.text
    with fop.CheckpointManager(out, read_only=True) as mngr:
        assert mngr.steps() == [10, 20]


def test_a_run_with_only_unfinished_saves_says_so(plain_run, tmp_path, capsys):
    path = tmp_path / "run"
    path.mkdir()
    shutil.copytree(plain_run / "20", path / "20.orbax-checkpoint-tmp-17961")
    (path / "999").mkdir()
    for call in (
        lambda: _importing.import_orbax(path, tmp_path / "out"),
        lambda: fop.restore(path),
        lambda: fop.restore_params(path),
    ):
        with pytest.raises(CheckpointNotFoundError, match=r"no finalized steps.*999.*tmp-17961"):
            call()
    assert cli.main(["import", str(path), str(tmp_path / "out")]) == cli.EXIT_ERROR
    assert "an unfinished Orbax save" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_steps_of_an_older_orbax_without_a_step_record(plain_run, tmp_path):
    """Orbax before _CHECKPOINT_METADATA: a step is its item folders (with _METADATA)."""
    path = tmp_path / "old"
    shutil.copytree(plain_run, path)
    for step in ("10", "20"):
        os.remove(path / step / "_CHECKPOINT_METADATA")
    (path / "5").mkdir()  # a folder of the user's beside them: no step
    (path / "5" / "results.csv").write_text("a,b\n")
    assert _foreign.is_orbax_checkpoint(path)
    assert _orbax_reader.orbax_steps(path) == [10, 20]
    _same(fop.restore(path)["default"], _params(20))
    _same(fop.restore_params(path, step=10), _params(10))
    assert _importing.import_orbax(path, tmp_path / "ours") == [10, 20]


def test_step_names_orbax_options_give(tmp_path):
    """step_prefix (with an underscore in it) and step_format_fixed_length."""
    path = tmp_path / "prefixed"
    options = ocp.CheckpointManagerOptions(step_prefix="my_run", step_format_fixed_length=5)
    with ocp.CheckpointManager(path, options=options) as mngr:
        for step in (3, 12):
            mngr.save(step, args=ocp.args.StandardSave(_params(step)))
        mngr.wait_until_finished()
    assert sorted(os.listdir(path)) == ["my_run_00003", "my_run_00012"]
    assert _orbax_reader.orbax_steps(path) == [3, 12]
    _same(fop.restore(path)["default"], _params(12))
    _same(fop.restore_params(path, step=3), _params(3))
    assert _importing.import_orbax(path, tmp_path / "ours") == [3, 12]
    assert fop.restore(tmp_path / "ours" / "12" / "params") is not None


def test_steps_named_two_ways_are_refused_not_guessed(plain_run, tmp_path):
    path = tmp_path / "run"
    shutil.copytree(plain_run, path)
    shutil.copytree(path / "10", path / "backup_50")  # a user's copy of an old step
    for call in (
        lambda: fop.restore(path),
        lambda: fop.restore_params(path),
        lambda: _importing.import_orbax(path, tmp_path / "out"),
    ):
        with pytest.raises(CorruptCheckpointError, match=r"named in 2 ways.*'10'.*'backup_50'"):
            call()
    shutil.rmtree(path / "backup_50")
    shutil.copytree(path / "10", path / "0020")
    with pytest.raises(CorruptCheckpointError, match=r"step 20 appears twice"):
        fop.restore(path)


def test_an_orbax_step_among_our_steps_is_never_restored_as_the_run(plain_run, tmp_path, capsys):
    path = tmp_path / "mine"
    with fop.CheckpointManager(path, async_save=False) as mngr:
        mngr.save(1, {"params": _params(1)})
    shutil.copytree(plain_run / "20", path / "20")  # a foreign step above ours
    for call in (
        lambda: fop.restore(path),
        lambda: _importing.import_orbax(path, tmp_path / "out"),
    ):
        with pytest.raises(CheckpointNotFoundError, match=r"not an Orbax run.*library \(1\)"):
            call()
    assert cli.main(["import", str(path), str(tmp_path / "out")]) == cli.EXIT_ERROR
    assert "not an Orbax run" in capsys.readouterr().err
    _same(fop.restore_params(path), _params(1))


def _upload(local, location):
    kv = location.kvstore()
    for root, _, files in os.walk(local):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                kv.write(os.path.relpath(full, local), f.read()).result()


def test_gcs_step_without_its_commit_file_is_passed_over(plain_run, gcs_location, caplog, tmp_path):
    """On GCS orbax finalizes a step by writing commit_success.txt last (no rename)."""
    _upload(plain_run, gcs_location)
    gcs_location.delete("20/commit_success.txt")  # step 20: still being written
    with caplog.at_level(logging.WARNING, logger=READER_LOG):
        _same(fop.restore(gcs_location.url)["default"], _params(10))
    assert "'20' (no commit_success.txt" in caplog.text
    _same(fop.restore_params(gcs_location.url), _params(10))
    assert _importing.import_orbax(gcs_location.url, tmp_path / "ours") == [10]


def test_s3_run_with_stray_entries(plain_run, s3_location, tmp_path, caplog):
    """An S3 console's empty "folder" (a key ending in '/'), a file named like a step."""
    _upload(plain_run, s3_location)
    kv = s3_location.kvstore()
    for key in ("999/", "1000", ".DS_Store"):
        kv.write(key, b"").result()
    with caplog.at_level(logging.WARNING, logger=READER_LOG):
        _same(fop.restore(s3_location.url)["default"], _params(20))
    assert "'999' (nothing stored under it)" in caplog.text
    _same(fop.restore_params(s3_location.url), _params(20))
    assert cli.main(["import", s3_location.url, str(tmp_path / "ours")]) == 0
    _same(fop.restore_params(tmp_path / "ours", step=10), _params(10))


@pytest.mark.distributed
def test_a_run_two_orbax_processes_wrote_is_read_by_processes_and_alone(tmp_path):
    """Two real processes: Orbax's own CheckpointManager writes steps 1 and 2 (each
    process its shards; best_fn metrics), then restore_params and fop.restore read
    the run with a like sharded over both while step 2 is hidden from the last process
    until it listed: both read the primary's latest step (was: process 1 read step 1's
    shards beside process 0's step 2, no error). Then one process reads and imports it."""
    from _mp_workers import expected_w
    from _multiprocess import run_processes

    path = tmp_path / "run"
    run = run_processes(
        "_orbax_workers:orbax_saves_then_reads_while_a_step_lands",
        2,
        devices_per_process=2,
        args={"directory": str(path)},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        heartbeat_timeout_s=30,
        timeout_s=150,
    )
    for proc in run.check().procs:
        assert proc.result == {"restore_params": [2], "restore": [2]}
    assert sorted(os.listdir(path / "2" / "default")).count("ocdbt.process_1") == 1
    got = fop.restore(path)
    assert got["metrics"] == {"loss": 0.5}
    np.testing.assert_array_equal(got["default"]["w"], expected_w(4) + 2)
    np.testing.assert_array_equal(fop.restore_params(path, step=1)["w"], expected_w(4) + 1)
    out = tmp_path / "ours"
    assert _importing.import_orbax(path, out) == [1, 2]
    assert _extras(out, 1) == {"loss": 1.0}


def test_a_train_state_restores_from_the_one_tree_of_an_orbax_step(tmp_path):
    """Orbax's usual run: ``StandardSave(state)`` of a Flax TrainState ('default' item).
    ``fop.restore(run, like=state)`` gives the TrainState back; a dict like naming no
    item says which item holds the tree."""
    import optax
    from flax.training import train_state

    params = _params(3)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    state = state.replace(step=7)
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(7, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    like = train_state.TrainState.create(apply_fn=None, params=_params(0), tx=optax.adam(1e-3))
    got = fop.restore(tmp_path / "run", like)
    assert type(got) is train_state.TrainState and int(got.step) == 7
    _same(got.params, params)
    _same(got.opt_state, state.opt_state)
    with pytest.raises(StructureError, match=r"for the tree of item 'default': like=\{'default'"):
        fop.restore(tmp_path / "run", {"params": params})
