"""Format version 2: each process's chunks packed into a few data files per item.

Real processes (2 x 2 devices) save and reshard; the one-process parent restores,
verifies and damages what they wrote; the golden v2 checkpoint restores bit for bit;
the S3 server sees a few objects per save; a manager step of version 2 is copied to a
persistent tier file by file."""

import json
import os

import _mp_workers
import golden
import numpy as np
import pytest
from _files import flip_byte
from _multiprocess import run_processes
from _s3_requests import S3Requests
from _trees import assert_same_tree

import flax_orbax_plugin as fop

pytest_plugins = ["_servers"]
G = golden.GOLDEN


def _tree():
    rng = np.random.default_rng(0)
    return {
        "w": rng.random((700, 1100), dtype=np.float32),  # 3 MiB: several chunks
        "emb": rng.random((3000, 512)).astype(np.float32),  # 6 MiB
        "small": {f"l{i}": np.full((i + 1,), i, np.int32) for i in range(50)},
        "s": 3,
        "name": "v2",
    }


def _files(path):
    return sorted(
        os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs
    )


@pytest.mark.distributed
def test_two_processes_save_reshard_and_one_process_restores_and_verifies(tmp_path):
    d = str(tmp_path / "run")
    result = run_processes(
        "_v2_workers:save_and_reshard", 2, devices_per_process=2, args={"directory": d}
    )
    assert all(p.ok for p in result.procs), [p.describe() for p in result.procs]
    want = ["_COMMITTED", "_METADATA.json"]
    want += ["data/0-0.bin", "data/0.json", "data/1-0.bin", "data/1.json"]
    path = f"{d}/1"
    assert _files(path) == want  # a small constant per process, whatever the leaves
    assert json.load(open(f"{path}/_METADATA.json"))["format_version"] == 2
    out = fop.restore(path)
    full = _mp_workers.expected_w(4) + 1
    np.testing.assert_array_equal(out["params"]["w"], full)
    np.testing.assert_array_equal(out["opt_state"]["mu"], -full)
    assert [r.ok for r in fop.verify(path)] == [True]
    # One flipped byte inside process 1's data file: restore names the leaf, verify
    # reports it, and the data index's own checksum guards the index.
    flip_byte(f"{path}/data/1-0.bin", 100)
    with pytest.raises(fop.CorruptCheckpointError, match="crc32c"):
        fop.restore(path)
    (bad,) = fop.verify(path)
    assert not bad.ok and "crc32c" in bad.error
    with open(f"{path}/data/0.json", "r+b") as f:
        f.write(b" ")
    with pytest.raises(fop.CorruptCheckpointError, match=r"data/0.json: checksum mismatch"):
        fop.restore(path)


@pytest.mark.distributed
def test_two_processes_on_s3_write_their_own_objects_and_reshard(s3_location):
    result = run_processes(
        "_v2_workers:save_and_reshard",
        2,
        devices_per_process=2,
        args={"directory": s3_location.url},
        env=s3_location.env,
    )
    assert all(p.ok for p in result.procs), [p.describe() for p in result.procs]
    assert s3_location.join("1").keys() == [
        "_COMMITTED",
        "_METADATA.json",
        "data/0-0.bin",
        "data/0.json",
        "data/1-0.bin",
        "data/1.json",
    ]
    np.testing.assert_array_equal(
        fop.restore(s3_location.url + "/1")["params"]["w"], _mp_workers.expected_w(4) + 1
    )


def test_data_files_roll_over_at_their_target_and_resharding_reads_only_needed_chunks(
    tmp_path,
):
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from flax_orbax_plugin._zarr import packed_reader

    tree = _tree()
    path = tmp_path / "c"
    fop.save(path, tree, format_version=2, data_file_bytes=5 << 20)
    files = _files(path)
    bins = [f for f in files if f.endswith(".bin")]
    assert 2 <= len(bins) <= 4 and all(os.path.getsize(path / f) <= 5 << 20 for f in bins)
    assert [f for f in files if not f.endswith(".bin")] == [
        "_COMMITTED",
        "_METADATA.json",
        "data/0.json",
    ]
    assert_same_tree(tree, fop.restore(path))
    # Rows 100..199 of "emb" onto one device: only the chunks holding them are read.
    read = []
    real = packed_reader.PackedReader._fill_segment

    def spy(self, key, name, parts):
        read.append(key)
        return real(self, key, name, parts)

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    cols = NamedSharding(mesh, P(None, "x"))
    like = {"emb": jax.ShapeDtypeStruct((3000, 512), np.float32, sharding=cols)}
    packed_reader.PackedReader._fill_segment = spy
    try:
        got = fop.restore(path, like=like, partial=True)
    finally:
        packed_reader.PackedReader._fill_segment = real
    np.testing.assert_array_equal(np.asarray(got["emb"]), tree["emb"])
    leaves = json.load(open(path / "_METADATA.json"))["leaves"]
    (emb,) = [i for i, leaf in enumerate(leaves) if leaf["path"] == "emb"]
    assert read and all(k.startswith(f"d/{emb}/c/") for k in read), read


def test_golden_v2_checkpoint_restores_bit_exact_verifies_and_exports(tmp_path):
    want = golden.every_leaf_kind()
    path = os.path.join(G, "v2_leaf_kinds")
    assert json.load(open(os.path.join(path, "_METADATA.json")))["format_version"] == 2
    out = fop.restore(path, like=want)
    for k in ("f32", "bf16", "u64", "c64", "big", "zero_size"):
        assert np.asarray(out[k]).tobytes() == np.asarray(want[k]).tobytes(), k
    assert out["py_int"] == want["py_int"] and out["none"] is None
    assert all(r.ok for r in fop.verify(path))
    # Export reads version 2 like version 1.
    arrays = {"big": want["big"], "f32": want["f32"]}
    fop.save(tmp_path / "c", arrays, format_version=2)
    fop.to_safetensors(tmp_path / "c", tmp_path / "out")
    assert_same_tree(arrays, fop.from_safetensors(tmp_path / "out", like=arrays))


def test_s3_save_writes_a_few_objects_and_restores_with_range_reads(s3_location, tmp_path):
    tree = _tree()
    s3_location, bucket = s3_location.join("c"), s3_location
    with S3Requests() as requests:
        fop.save(s3_location.url, tree, format_version=2, data_file_bytes=4 << 20)
        requests.settle()
        put_v2 = requests.take().get("PUT", 0)
    keys = s3_location.keys()
    assert len([k for k in keys if k.endswith(".bin")]) <= 5, keys
    assert len(keys) <= 8, keys
    assert put_v2 <= 12
    assert_same_tree(tree, fop.restore(s3_location.url))
    assert all(r.ok for r in fop.verify(s3_location.url))
    # A manager step of version 2, replicated file for file to a persistent tier on S3.
    persistent = bucket.join("p").url
    with fop.CheckpointManager(tmp_path / "run", format_version=2, persistent=persistent) as m:
        m.save(1, {"params": tree}, ignore_policy=True)
    assert _files(tmp_path / "run" / "1")[-3:] == [
        "params/_METADATA.json",
        "params/data/0-0.bin",
        "params/data/0.json",
    ]
    assert_same_tree(tree, fop.restore_params(persistent))
    keys = [k for k in bucket.join("p").keys() if k.startswith("1/params/")]
    assert keys == ["1/params/_METADATA.json", "1/params/data/0-0.bin", "1/params/data/0.json"]


def test_incremental_manager_steps_of_version_2_link_the_unchanged_data_file(tmp_path):
    tree = {"w": np.arange(300_000, dtype=np.float32), "b": np.ones(3, np.float32)}
    with fop.CheckpointManager(tmp_path / "run", format_version=2, incremental=True) as m:
        m.save(1, {"params": tree})
        m.wait()
        m.save(2, {"params": tree})
        m.wait()
        second = m.last_save
    assert second.bytes_reused == tree["w"].nbytes and second.bytes_written == 12
    for step in (1, 2):  # one file, shared (tests/incremental/test_incremental_v2.py)
        path = tmp_path / "run" / str(step) / "params"
        assert os.stat(path / "data" / "0-0.bin").st_nlink == 2
    assert_same_tree(tree, fop.restore_params(tmp_path / "run"))


def test_gcs_save_restores_and_verifies_from_a_few_objects(gcs_location):
    tree = _tree()
    fop.save(gcs_location.url, tree, format_version=2, data_file_bytes=5 << 20)
    keys = gcs_location.keys()
    assert keys[:2] == ["_COMMITTED", "_METADATA.json"] and len(keys) <= 7, keys
    assert_same_tree(tree, fop.restore(gcs_location.url))
    assert all(r.ok for r in fop.verify(gcs_location.url))


@pytest.mark.parametrize("big", [False, True])
def test_damage_in_a_data_file_names_that_file_not_a_version_1_chunk_file(tmp_path, big):
    """A flipped byte in ``params/data/0-0.bin`` was reported as ``batch file
    b/0.float32/c/0`` (version 1's file, which a version-2 step does not have): the
    error names the data file and the bytes, in verify and restore."""
    leaf = np.arange(1 << 19 if big else 100, dtype=np.float32)  # its own array, or batched
    with fop.CheckpointManager(tmp_path / "run", format_version=2) as mngr:
        mngr.save(1, {"params": {"w": leaf}})
    data = tmp_path / "run" / "1" / "params" / "data"
    [name] = [p.name for p in data.iterdir() if p.suffix == ".bin"]
    flip_byte(data / name, 40)
    [result] = fop.verify(tmp_path / "run" / "1")
    with pytest.raises(fop.CorruptCheckpointError) as restored:
        fop.restore(tmp_path / "run" / "1" / "params")
    for said in (str(result.error), str(restored.value)):
        assert f"data file data/{name}, bytes " in said, said
        assert "batch file" not in said and "checksum mismatch" in said, said
