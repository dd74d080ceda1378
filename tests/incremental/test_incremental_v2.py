"""Incremental steps of format version 2: whole data files of the previous step reused.

A manager with ``format_version=2, incremental=True`` hard-links (local disk) or copies
on the server (the real moto S3 server, the GCS emulator) each previous data file of
which most bytes are unchanged leaves; the rest is written. The tests count what was
written, delete the previous step through retention and restore bit for bit, damage a
data file to see restore and ``verify`` name the leaf, and run two real processes that
each link their own data file."""

import json
import logging
import os

import numpy as np
import pytest
from _s3_requests import S3Requests
from test_incremental import BASE_SHAPE, _mp_base

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import CorruptCheckpointError
from flax_orbax_plugin._zarr import arrays as _arrays

pytest_plugins = ["_servers"]

MiB = 1 << 20
W1, W2, ADAPTER = 3 * MiB, 2 * MiB, 2 * MiB
SMALL = 64  # the batch of the bias: 16 float32


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(_arrays, "CHUNK_TARGET_BYTES", 1 * MiB)  # several chunks per leaf


def _state(adapter=0.0, w1_seed=0):
    rng = np.random.default_rng(0)
    return {
        "params": {
            "base": {
                "w1": np.random.default_rng(w1_seed).standard_normal((768, 1024), np.float32),
                "w2": rng.integers(0, 1 << 30, (512, 1024), dtype=np.int32),
            },
            "adapter": np.full((512, 1024), adapter, np.float32),
            "bias": np.zeros((16,), np.float32),  # batched: never reused
        }
    }


def _save(mngr, step, state):
    mngr.save(step, state, ignore_policy=True)
    mngr.wait()
    return mngr.last_save


def _equal(want, got):
    for k, v in want.items():
        if isinstance(v, dict):
            _equal(v, got[k])
        else:
            assert np.asarray(got[k]).dtype == v.dtype, k
            assert np.asarray(got[k]).tobytes() == v.tobytes(), k


def _data(root, step):
    """{data file name: os.stat} of ``params`` of ``step`` (local)."""
    d = os.path.join(root, str(step), "params", "data")
    return {n: os.stat(os.path.join(d, n)) for n in sorted(os.listdir(d)) if n.endswith(".bin")}


def _segment(index: dict, metadata: dict, path: str):
    """(data file, offset, length) of the first chunk of leaf ``path``."""
    (i,) = [i for i, r in enumerate(metadata["leaves"]) if r["path"] == path]
    key = min(k for k in index["chunks"] if k.startswith(f"d/{i}/c/"))
    number, offset, length, _ = index["chunks"][key]
    return index["files"][number]["name"], offset, length


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


def test_local_v2_steps_link_mostly_unchanged_data_files_and_survive_retention(tmp_path):
    root = tmp_path / "run"
    states = [_state(1.0), _state(2.0), _state(3.0), _state(4.0, w1_seed=1)]
    with fop.CheckpointManager(root, format_version=2, incremental=True, keep=2) as m:
        first = _save(m, 1, states[0])
        second = _save(m, 2, states[1])
        files1, files2 = _data(root, 1), _data(root, 2)
        # Step 1's one data file is 5 of its 7 MiB unchanged: linked, not rewritten; only
        # the adapter and the batch are written, into a second file of step 2.
        assert first.bytes_reused == 0 and first.bytes_written == W1 + W2 + ADAPTER + SMALL
        assert second.bytes_reused == W1 + W2 and second.bytes_written == ADAPTER + SMALL
        assert list(files2) == ["0-0.bin", "0-1.bin"]
        assert files2["0-0.bin"].st_ino == files1["0-0.bin"].st_ino
        assert files2["0-1.bin"].st_nlink == 1 and files2["0-1.bin"].st_size < 2.1 * MiB
        third = _save(m, 3, states[2])  # linked again; retention deletes step 1
        assert m.steps() == [2, 3] and third.bytes_reused == W1 + W2
        assert _data(root, 3)["0-0.bin"].st_ino == files1["0-0.bin"].st_ino
        # w1 changed too: only 2 of the file's 7 MiB unchanged, so all is written.
        fourth = _save(m, 4, states[3])
        assert fourth.bytes_reused == 0 and fourth.bytes_written == first.bytes_written
        assert all(s.st_nlink == 1 for s in _data(root, 4).values())
    with fop.CheckpointManager(root, read_only=True) as m:
        for step in (3, 4):
            _equal(states[step - 1], m.restore(step=step))
    assert all(r.ok for r in fop.verify(root, all_steps=True))


def test_local_v2_damage_in_a_reused_data_file(tmp_path, caplog):
    root = tmp_path / "run"
    states = [_state(1.0), _state(2.0), _state(3.0)]
    with fop.CheckpointManager(root, format_version=2, incremental=True, keep=1) as m:
        _save(m, 1, states[0])
        # Damage in place (under its old crc32c) in the previous step is not linked:
        # the link check reads the reused segments back.
        item = root / "1" / "params"
        index = json.loads((item / "data" / "0.json").read_bytes())
        meta = json.loads((item / "_METADATA.json").read_bytes())
        name, offset, _ = _segment(index, meta, "base/w1")
        data = (item / "data" / name).read_bytes()
        (item / "data" / name).write_bytes(_flip(data, offset + 100))
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            second = _save(m, 2, states[1])
        assert "its crc32c does not match its bytes" in caplog.text
        assert second.bytes_reused == 0 and m.steps() == [2]
        third = _save(m, 3, states[2])  # reuses step 2's, then deleted by retention
        assert third.bytes_reused == W1 + W2 and m.steps() == [3]
    _equal(states[2]["params"], fop.restore_params(root))
    # Damage to a reused segment of the new step: verify and restore name the leaf.
    item = root / "3" / "params"
    index = json.loads((item / "data" / "0.json").read_bytes())
    meta = json.loads((item / "_METADATA.json").read_bytes())
    name, offset, _ = _segment(index, meta, "base/w2")
    path = item / "data" / name
    assert os.stat(path).st_nlink == 1  # step 2 is gone; the bytes stayed
    path.write_bytes(_flip(path.read_bytes(), offset + 8))
    (result,) = fop.verify(root)
    assert not result.ok and "base/w2" in result.error
    with pytest.raises(CorruptCheckpointError, match="base/w2"):
        fop.restore_params(root)


def test_unchanged_leaves_not_taken_are_grouped_so_the_next_step_takes_them(tmp_path, monkeypatch):
    from flax_orbax_plugin._zarr import packed_writer

    monkeypatch.setattr(_arrays, "CHUNK_TARGET_BYTES", 2 * MiB)
    monkeypatch.setattr(packed_writer, "LOCAL_DATA_FILE_BYTES", 6 * MiB)
    rng = np.random.default_rng(3)
    frozen = [rng.standard_normal((384, 1024), np.float32) for _ in range(4)]  # 1 chunk

    def state(step):  # frozen leaves between changing ones (6 MiB, 3 chunks each)
        out = {}
        for i, f in enumerate(frozen):
            out[f"l{2 * i}"] = f
            out[f"l{2 * i + 1}"] = np.full((1536, 1024), float(step + i), np.float32)
        return {"params": out}

    root = tmp_path / "run"
    with fop.CheckpointManager(root, format_version=2, incremental=True) as m:
        _save(m, 1, state(1))
        # Step 1's 6 MiB files are about a quarter frozen: step 2 takes few or none, and
        # writes the frozen leaves it did not take first, side by side, which step 3
        # then takes (at least 3 of the 4, whatever order the writer's threads chose).
        second = _save(m, 2, state(2))
        third = _save(m, 3, state(3))
    assert second.bytes_reused <= 2 * frozen[0].nbytes, second
    assert third.bytes_reused >= 3 * frozen[0].nbytes, third
    total = second.bytes_written + second.bytes_reused
    assert third.bytes_written + third.bytes_reused == total
    with fop.CheckpointManager(root, read_only=True) as m:
        for step in (2, 3):
            _equal(state(step), m.restore(step=step))


@pytest.mark.parametrize("damage", ["truncate", "symlink"])
def test_local_v2_a_short_or_symlinked_previous_data_file_means_write(tmp_path, damage, caplog):
    root = tmp_path / "run"
    states = [_state(1.0), _state(2.0)]
    outside = tmp_path / "outside.bin"
    with fop.CheckpointManager(root, format_version=2, incremental=True, keep=2) as m:
        _save(m, 1, states[0])
        victim = root / "1" / "params" / "data" / "0-0.bin"
        data = victim.read_bytes()
        victim.unlink()
        if damage == "truncate":
            victim.write_bytes(data[:-100])
        else:
            outside.write_bytes(data)
            os.symlink(outside, victim)
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            second = _save(m, 2, states[1])
    assert "data files are written, not reused" in caplog.text
    assert second.bytes_reused == 0 and second.bytes_written == W1 + W2 + ADAPTER + SMALL
    files = _data(root, 2)
    assert list(files) == ["0-0.bin"] and files["0-0.bin"].st_nlink == 1
    if damage == "symlink":
        assert outside.read_bytes() == data and os.stat(outside).st_nlink == 1
    _equal(states[1]["params"], fop.restore_params(root))


def test_s3_v2_steps_copy_data_files_on_the_server(s3_location):
    url = s3_location.url
    states = [_state(1.0), _state(2.0)]
    with fop.CheckpointManager(url, format_version=2, incremental=True, keep=1) as m:
        first = _save(m, 1, states[0])
        with S3Requests() as requests:
            second = _save(m, 2, states[1])
            requests.settle()
            counts = requests.take()
        assert m.steps() == [2]  # retention deleted step 1
    assert second.bytes_reused == W1 + W2 and second.bytes_written == ADAPTER + SMALL
    keys = [k for k in s3_location.keys() if k.startswith("2/params/data/")]
    assert keys == ["2/params/data/0-0.bin", "2/params/data/0-1.bin", "2/params/data/0.json"]
    size = len(s3_location.read("2/params/data/0-0.bin"))
    assert size >= W1 + W2 + ADAPTER == first.bytes_written - SMALL  # step 1's whole file
    assert counts["PUT"] <= 8, counts  # the copy, the new file, the JSON files
    assert not [k for k in s3_location.keys() if k.startswith("1/")]
    _equal(states[1]["params"], fop.restore_params(url))
    assert all(r.ok for r in fop.verify(url))
    # A damaged reused segment of the copy is reported, naming the leaf.
    index = json.loads(s3_location.read("2/params/data/0.json"))
    meta = json.loads(s3_location.read("2/params/_METADATA.json"))
    name, offset, _ = _segment(index, meta, "base/w1")
    kv = s3_location.kvstore()
    key = f"2/params/data/{name}"
    kv.write(key, _flip(s3_location.read(key), offset + 8)).result()
    (result,) = fop.verify(url)
    assert not result.ok and "base/w1" in result.error
    with pytest.raises(CorruptCheckpointError, match="base/w1"):
        fop.restore_params(url)


# -- several processes ---------------------------------------------------------------------


@pytest.mark.distributed
def test_two_processes_each_link_their_own_data_file_of_a_frozen_base(tmp_path):
    from _multiprocess import run_processes

    d = str(tmp_path / "steps")
    run = run_processes(
        "test_incremental:mp_frozen_base",  # the version-1 test's worker, format 2
        2,
        devices_per_process=2,
        args={"directory": d, "steps": [1, 2, 3], "keep": 2, "format_version": 2},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        heartbeat_timeout_s=30,
        timeout_s=120,
    ).check()
    base = BASE_SHAPE[0] * BASE_SHAPE[1] * 4
    for r in run.results:  # each process: half the base (2 of 4 shards), half the adapter
        assert r["1"] == [(base + ADAPTER) // 2, 0]
        assert r["2"] == r["3"] == [ADAPTER // 2, base // 2]
        assert r["steps"] == [2, 3]  # step 1 deleted by retention
    two, three = _data(d, 2), _data(d, 3)
    assert sorted(three) == ["0-0.bin", "0-1.bin", "1-0.bin", "1-1.bin"]
    for name in ("0-0.bin", "1-0.bin"):  # each process's frozen-base file, linked
        assert three[name].st_ino == two[name].st_ino and three[name].st_nlink == 2
    with fop.CheckpointManager(d, read_only=True) as reader:
        for step in (2, 3):
            got = reader.restore(step=step)["params"]
            assert got["base"].tobytes() == _mp_base().tobytes()
            want = np.full((512, 1024), float(step), np.float32)
            assert got["adapter"].tobytes() == want.tobytes()
    assert all(r.ok for r in fop.verify(d, all_steps=True))


def test_gcs_v2_steps_rewrite_data_files_on_the_server(gcs_location, caplog):
    url = gcs_location.url
    states = [_state(1.0), _state(2.0)]
    with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
        with fop.CheckpointManager(url, format_version=2, incremental=True, keep=1) as m:
            _save(m, 1, states[0])
            second = _save(m, 2, states[1])
            assert m.steps() == [2]
    assert "incremental save" not in caplog.text  # nothing fell back to a write
    assert second.bytes_reused == W1 + W2 and second.bytes_written == ADAPTER + SMALL
    assert [k for k in gcs_location.keys() if k.startswith("2/params/data/")] == [
        "2/params/data/0-0.bin",
        "2/params/data/0-1.bin",
        "2/params/data/0.json",
    ]
    _equal(states[1]["params"], fop.restore_params(url))
    assert all(r.ok for r in fop.verify(url))


KILLED_CHILD = """
import sys
import flax_orbax_plugin as fop
from flax_orbax_plugin._zarr import arrays as _arrays
_arrays.CHUNK_TARGET_BYTES = 1 << 20
sys.path.insert(0, sys.argv[2])  # this test's wing (tests/support: child_env)
from test_incremental_v2 import _state
with fop.CheckpointManager(
    sys.argv[1], format_version=2, incremental=True, keep=int(sys.argv[3]) or None
) as m:
    m.save(2, _state(2.0))
    m.wait()
"""


@pytest.mark.parametrize("phase", ["mid_write", "mid_retention"])
def test_a_kill_during_an_incremental_v2_step_leaves_a_whole_step(tmp_path, phase):
    """Killed after the data file was taken (mid_write: the first chunk write follows),
    or while retention deletes step 1 whose data file step 2 shares: the next writer
    restores a whole step, lists nothing partial, and reuses again."""
    import subprocess
    import sys

    import _proc

    d = str(tmp_path)
    with fop.CheckpointManager(d, format_version=2, incremental=True) as m:
        _save(m, 1, _state(1.0))
    env = _proc.child_env(JAX_PLATFORMS="cpu", FOP_KILL_AT=phase)
    keep = "1" if phase == "mid_retention" else "0"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CHILD, d, here, keep],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    with fop.CheckpointManager(d, format_version=2, incremental=True) as m:
        steps = m.steps()
        assert steps == {"mid_write": [1], "mid_retention": [2]}[phase]
        assert sorted(os.listdir(d)) == sorted([".writer.lock", *map(str, steps)])
        assert all(s.st_nlink == 1 for s in _data(d, steps[0]).values())  # nothing left over
        for s in steps:
            _equal(_state(float(s)), m.restore(step=s))
        assert _save(m, 3, _state(3.0)).bytes_reused == W1 + W2
    assert all(r.ok for r in fop.verify(d, all_steps=True))
