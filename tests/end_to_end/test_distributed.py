"""Several real JAX processes on 127.0.0.1 saving and restoring one sharded state.

Each test starts 2, 3 or 4 processes with ``jax.distributed.initialize`` (CPU, gloo
collectives, 2 devices each, one global mesh) through ``tests/support/_multiprocess.py``; the
functions they run are in ``tests/support/_mp_workers.py``. Select with ``-m distributed``.

What they show:

* each process writes only its own shards (its /proc/self/io write counters match
  the bytes of its addressable replica-0 shards, not the whole state), and only
  process 0 writes the metadata and the commit marker;
* a checkpoint saved by 4 processes restores onto 2 processes with another mesh,
  and one saved by 2 processes restores into this single process (8 devices);
* async saves from several processes, with the saved buffers replaced right away;
* a process SIGKILLed in the middle of a save: no step is committed, the survivors
  fail within a bounded time with an error naming the missing process (its heartbeat
  stopped: ``_base/regions.py``, and tests/end_to_end/test_liveness.py);
* the same on a bucket (moto S3 on 127.0.0.1), through the manager: several
  processes write one step, retention, and a process killed mid-save;
* decisions about the store are the primary's (a late process on S3 and GCS, through
  fop.save, save_async and the manager), and restores are agreed: damage only one
  process reads fails on all and every process resumes the same step; serving
  processes read one step while another lands; a process may still restore alone;
* one process failing inside each collective operation (a manager's open, save, restore
  and wait, fop.save / save_async / restore, restore_params, the tier's replication
  rounds) raises on every process within seconds, naming it (not after the timeout),
  on a local directory, S3 and GCS.

What a dead process looks like to the others (jax 0.10.2): a barrier that times
out first raises "DEADLINE_EXCEEDED: Barrier timed out ... Some timed out task
names: 1" (the core wraps it in CoordinationError); once the heartbeat timeout
passes, barriers fail with "Task 1 heartbeat timeout" and jax then terminates the
survivors itself (SIGABRT, "Terminating process because the JAX distributed service
detected fatal errors ... stopped sending heartbeats: 1"). If process 0 dies, the
service goes with it: survivors get UNAVAILABLE at once and are terminated likewise.
"""

import os
import re
import time

import _mp_workers as W
import jax
import numpy as np
import pytest
from _multiprocess import Kill, run_processes
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop

pytestmark = pytest.mark.distributed
pytest_plugins = ["_servers"]

# Failures must end quickly: a barrier gives up after this long (the core reads it).
FAST_FAIL = {"FOP_COORDINATION_TIMEOUT_S": "20"}


def _run(target, n, **kw):
    kw.setdefault("env", FAST_FAIL)
    kw.setdefault("heartbeat_timeout_s", 30)
    kw.setdefault("timeout_s", 120)
    return run_processes(target, n, devices_per_process=2, **kw)


def _state_nbytes(n_devices: int) -> int:
    w = W.ROWS_PER_DEVICE * n_devices * W.COLS * 4
    return 2 * w + W.COLS * 4  # w, mu and the replicated b (written once)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints written by 2 and by 4 processes (step 1), and what each process saw."""
    out = {}
    for n in (2, 4):
        directory = str(tmp_path_factory.mktemp(f"saved{n}"))
        run = _run("_mp_workers:core_save", n, args={"directory": directory, "steps": [1]})
        run.check()
        out[n] = (directory, run)
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_each_process_writes_only_its_own_shards(saved, n):
    directory, run = saved[n]
    total = _state_nbytes(2 * n)
    mine = [p.result["saves"][0]["mine"] for p in run.procs]
    assert sum(mine) == total
    for p in run.procs:
        save = p.result["saves"][0]
        io = save["io"]
        # The kernel's count of bytes this process wrote while saving: its own
        # shards (zarr3 framing, metadata and json add a little), far from the total.
        written = io["write_bytes"] or io["wchar"]
        assert save["mine"] * 0.95 <= written <= save["mine"] * 1.2 + (256 << 10), (
            p.process_id,
            save,
        )
        assert written < total / n * 1.5, (p.process_id, written, total)
        assert all(p.result["committed"])
    # Only the primary writes the small files: metadata, then the commit marker.
    primary_files = [f.rsplit("/", 1)[-1] for f in run[0].result["small_files"]]
    assert primary_files[-1] == "_COMMITTED", primary_files
    assert "_METADATA.json" in primary_files
    for p in run.procs[1:]:
        assert p.result["small_files"] == [], (p.process_id, p.result["small_files"])
    # On disk: one committed step holding every byte once.
    on_disk = sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(os.path.join(directory, "1"))
        for f in files
    )
    assert total <= on_disk <= total * 1.1 + (256 << 10)
    assert fop.is_committed(os.path.join(directory, "1"))
    assert sorted(os.listdir(directory)) == ["1"]


@pytest.mark.parametrize(
    "spec, expected",
    [([0, 1], "('m0', 'm1')"), ([1, 0], "('m1', 'm0')")],
    ids=["rows-by-process", "columns-by-process"],
)
def test_restore_4_processes_onto_2_with_another_mesh(saved, spec, expected):
    """Saved over a mesh of 8 (rows sharded), restored over 2x2 on 2 processes."""
    directory, _ = saved[4]
    run = _run(
        "_mp_workers:core_restore",
        2,
        args={"directory": directory, "step": 1, "mesh_shape": [2, 2], "spec": spec},
    ).check()
    rows = W.ROWS_PER_DEVICE * 8
    for p in run.procs:
        assert p.result["rows"] == rows
        assert p.result["checked_shards"] == 2
        assert p.result["sharding"].endswith(expected), p.result["sharding"]


def test_restore_onto_fewer_processes_reads_only_the_rows_each_needs(saved):
    """Saved over 8 devices (128-row chunks), restored over 2x2 on 2 processes with
    rows split by process: each process needs half of the rows of w and mu (and all
    of the replicated b), and reads that half (with the chunk indexes), not more."""
    directory, _ = saved[4]
    run = _run(
        "_mp_workers:core_restore",
        2,
        args={"directory": directory, "step": 1, "mesh_shape": [2, 2], "spec": [0, 1]},
    )
    if not all(p.ok for p in run.procs):  # not the finding: fail, whatever the mark
        raise RuntimeError("\n".join(p.describe() for p in run.procs))
    half = (_state_nbytes(8) - W.COLS * 4) // 2 + W.COLS * 4
    metadata = os.path.getsize(os.path.join(directory, "1", "_METADATA.json"))
    for p in run.procs:
        io = p.result["io"]
        # Array bytes read, as tensorstore and the chunk reader count their file reads.
        data = io["array_bytes_read"]
        assert half <= data <= 1.02 * half + (64 << 10), (p.process_id, half, io)
        # All the process read meanwhile (the kernel's count): that, the metadata, and
        # under 1 MiB of the process's own reads (lazy imports, /proc).
        assert data + metadata <= io["rchar"] <= data + metadata + (1 << 20), (p.process_id, io)


def test_restore_2_processes_into_one(saved, devices):
    directory, _ = saved[2]
    rows = W.ROWS_PER_DEVICE * 4
    mesh = Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
    sharding = NamedSharding(mesh, P(("a", "b")))
    like = {
        "params": {
            "w": jax.ShapeDtypeStruct((rows, W.COLS), np.float32, sharding=sharding),
            "b": jax.ShapeDtypeStruct((W.COLS,), np.float32, sharding=NamedSharding(mesh, P())),
        },
        "opt_state": {"mu": jax.ShapeDtypeStruct((rows, W.COLS), np.float32, sharding=sharding)},
    }
    state = fop.restore(os.path.join(directory, "1"), like)
    assert W.check_state(state, rows, 1)["checked_shards"] == 8
    host = fop.restore(os.path.join(directory, "1"))  # and to numpy on the host
    np.testing.assert_array_equal(host["params"]["w"], W.expected_w(4) + 1)


def test_async_saves_across_processes(tmp_path):
    directory = str(tmp_path)
    run = _run(
        "_mp_workers:core_save",
        2,
        args={"directory": directory, "steps": [1, 2, 3], "async_save": True, "work_between": True},
    ).check()
    for p in run.procs:
        assert p.result["committed"] == [True, True, True]
    for step in (1, 2, 3):
        host = fop.restore(os.path.join(directory, str(step)))
        np.testing.assert_array_equal(host["params"]["w"], W.expected_w(4) + step)
        np.testing.assert_array_equal(host["opt_state"]["mu"], -(W.expected_w(4) + step))


# ------------------------------------------------------------------ a process dies mid-save


def _assert_step2_not_committed(directory):
    assert fop.is_committed(os.path.join(directory, "1"))
    assert not fop.is_committed(os.path.join(directory, "2"))
    assert "2" not in os.listdir(directory)
    with pytest.raises(fop.CheckpointError):
        fop.restore(os.path.join(directory, "2"))
    host = fop.restore(os.path.join(directory, "1"))
    np.testing.assert_array_equal(host["params"]["w"], W.expected_w(6) + 1)


def test_sigkill_mid_save_survivors_fail_naming_the_missing_process(tmp_path):
    """Process 1 of 3 dies while writing; its heartbeat stops, and the others name it
    dead once it was silent FOP_PEER_SILENT_S (3 s here), not when the coordination
    timeout (120 s) or jax's own heartbeat timeout (60 s) runs out."""
    directory = str(tmp_path)
    t = time.monotonic()
    run = _run(
        "_mp_workers:core_save_killed",
        3,
        args={"directory": directory},
        kill=Kill(process=1, at="mid_save"),
        env={"FOP_COORDINATION_TIMEOUT_S": "120", "FOP_PEER_SILENT_S": "3"},
        heartbeat_timeout_s=60,
        done_timeout_s=2,
    )
    assert time.monotonic() - t < 60
    assert run[1].killed
    for p in (run[0], run[2]):
        assert p.record.get("ok"), p.describe()
        res = p.result
        assert res["step1_committed"]
        # Its own look, or process 0's failure published first (a ProcessFailedError,
        # a CoordinationError that carries process 0's message): either names process 1.
        assert res["save2_type"] in ("CoordinationError", "ProcessFailedError"), res
        # Bounded: the silence allowed plus a look and slack, not the timeout.
        assert res["save2_s"] < 3 + 12, res
        assert "process 1 is dead: its heartbeat stopped" in res["save2"], res["save2"]
        # Names the barrier and, in jax's words, the task that never arrived.
        assert "from process 1" in res["save2"], res["save2"]  # the missing process, named
    _assert_step2_not_committed(directory)


def test_sigkill_mid_save_heartbeat_detects_the_dead_process(tmp_path):
    """With a short heartbeat timeout, jax itself marks the dead task and ends the others."""
    directory = str(tmp_path)
    run = _run(
        "_mp_workers:core_save_killed",
        3,
        args={"directory": directory},
        kill=Kill(process=1, at="mid_save"),
        env={"FOP_COORDINATION_TIMEOUT_S": "60"},
        heartbeat_timeout_s=3,
        done_timeout_s=2,
    )
    # The victim really died of SIGKILL at its kill point, mid-save (it never returned).
    assert run[1].killed and run[1].returncode == -9, run[1].describe()
    assert not run[1].record.get("ok"), run[1].describe()
    for p in (run[0], run[2]):
        assert not p.timed_out
        # Within the heartbeat timeout plus slack of the victim's death.
        assert p.wall_s - run[1].wall_s < 3 + 10, p.describe()
        # jax aborts survivors once it has seen the heartbeat timeout; whichever comes
        # first, the Python error or the runtime's fatal log, names task 1.
        said = (p.record.get("result") or {}).get("save2", "") + p.stderr
        assert "Task 1 heartbeat timeout" in said or "stopped sending heartbeats):\n1" in said, (
            p.describe()
        )
    _assert_step2_not_committed(directory)


def test_sigkill_primary_mid_save(tmp_path):
    """The primary hosts the coordination service: survivors learn of its death at once."""
    directory = str(tmp_path)
    run = _run(
        "_mp_workers:core_save_killed",
        3,
        args={"directory": directory},
        kill=Kill(process=0, at="mid_save"),
        heartbeat_timeout_s=30,
        done_timeout_s=2,
    )
    for p in (run[1], run[2]):
        assert not p.timed_out
        assert p.wall_s - run[0].wall_s < 15, p.describe()
        said = (p.record.get("result") or {}).get("save2", "") + p.stderr
        assert "coordination service" in said or "UNAVAILABLE" in said, p.describe()
    _assert_step2_not_committed(directory)


# ------------------------------------------------------------------ through the manager


def test_manager_multi_process_save_then_restore_in_one_process(tmp_path):
    directory = str(tmp_path)
    run = _run(
        "_mp_workers:manager_save",
        2,
        args={"directory": directory, "steps": [1, 2], "async_save": True, "keep": 1},
        heartbeat_timeout_s=5,
        done_timeout_s=2,
    )
    run.check()
    for p in run.procs:
        assert p.result["steps"] == [2]
    with fop.CheckpointManager(directory, read_only=True) as mngr:
        assert mngr.steps() == [2]
        host = mngr.restore()
    np.testing.assert_array_equal(host["params"]["w"], W.expected_w(4) + 2)


# ------------------------------------------------------------------ several processes, one bucket


def test_processes_save_to_s3_and_manager_commits(s3_location):
    """2 processes write their shards to one S3 prefix; then through the manager."""
    core = s3_location.join("core")
    run = _run(
        "_mp_workers:core_save",
        2,
        args={"directory": core.spec, "steps": [1]},
        env={**FAST_FAIL, **s3_location.env},
    ).check()
    assert [p.result["committed"] for p in run.procs] == [[True], [True]]
    host = fop.restore(core.join("1").spec)
    np.testing.assert_array_equal(host["params"]["w"], W.expected_w(4) + 1)

    mngr_loc = s3_location.join("run")
    run = _run(
        "_mp_workers:manager_save",
        2,
        args={"directory": mngr_loc.spec, "steps": [1, 2, 3], "async_save": True, "keep": 2},
        env={**FAST_FAIL, **s3_location.env},
    ).check()
    for p in run.procs:  # retention runs in the background: step 1 may still be listed
        assert p.result["steps"][-2:] == [2, 3], p.result
    assert {k.split("/")[0] for k in mngr_loc.keys()} == {"2", "3", "_RUN.json"}
    with fop.CheckpointManager(mngr_loc.spec, read_only=True) as reader:
        assert reader.steps() == [2, 3]
    host = fop.restore_params(mngr_loc.spec)
    np.testing.assert_array_equal(host["w"], W.expected_w(4) + 3)


_SAVE_V2 = ("_mp_workers:core_save", {"format_version": 2})
_SAVE_ASYNC = ("_mp_workers:core_save", {"async_save": True})
_MANAGER = ("_mp_workers:manager_save", {"steps": [1, 2]})


@pytest.mark.parametrize(
    "store, entry",
    [("s3", _SAVE_V2), ("s3", _MANAGER), ("gcs", _SAVE_ASYNC), ("gcs", _MANAGER)],
    ids=["s3-save-v2", "s3-manager", "gcs-save_async-v1", "gcs-manager"],
)
def test_a_late_process_on_an_object_store_follows_the_primarys_look_at_the_target(
    store, entry, request
):
    """On an object store every process writes into the target itself, so a process that
    starts its save late finds the others' objects already there. The target's check and
    clearing are the primary's alone, before anyone writes: the late process must neither
    clear them nor wait for a clearing the others skipped (which hung), on every store and
    entry point that saves."""
    loc = request.getfixturevalue(f"{store}_location").join("late")
    target, args = entry
    args = {"steps": [1], **args, "directory": loc.spec, "late_s": 2.0}
    run = _run(target, 2, args=args, env={**FAST_FAIL, **loc.env}, timeout_s=60).check()
    steps = args["steps"]
    if target.endswith("core_save"):
        assert [p.result["committed"] for p in run.procs] == [[True] * len(steps)] * 2
        w = fop.restore(W.step_path(loc.spec, steps[-1]))["params"]["w"]
    else:
        assert [p.result["steps"] for p in run.procs] == [steps, steps]
        w = fop.restore_params(loc.spec)["w"]
    np.testing.assert_array_equal(w, W.expected_w(4) + steps[-1])


@pytest.mark.parametrize("leaf", ["w", "r"], ids=["sharded", "replicated-shared-read"])
def test_damage_only_one_process_reads_fails_on_every_process_and_all_resume_one_step(
    tmp_path, leaf
):
    """A damaged chunk of step 2 that only the last process reads (a row block of a
    sharded leaf or of a replicated one): ``fop.restore`` onto a sharding over the
    processes raises CorruptCheckpointError on every process, the one that read it
    naming the file and the others naming that process, promptly (was: the others
    returned); the manager's restore of the latest (the replicated leaf read shared and
    all-gathered) brings every process back to step 1 (was: process 0 resumed step 2
    and process 1 step 1, without an error), and the step is set aside."""
    run = _run(
        "_mp_workers:damaged_where_one_process_reads",
        2,
        args={"directory": str(tmp_path), "leaf": leaf},
    ).check()
    last = run.procs[-1].result
    assert "crc32c" in last["core"] or "checksum" in last["core"], last["core"]
    for p in run.procs:
        assert p.result["core"].startswith("CorruptCheckpointError"), p.result["core"]
        assert p.result["core_s"] < 15, p.result
        assert p.result["restored_step"] == 1, p.result
        assert p.result["steps_after"] == [1], p.result
    assert "process 1 failed" in run.procs[0].result["core"]
    assert [p.result["values_of_step"] for p in run.procs] == [[1], [1]]
    assert any(n.startswith("2.corrupt-") for n in os.listdir(tmp_path))


def test_the_primary_may_restore_alone_when_nothing_is_read_shared(tmp_path):
    """Restores agree on their outcome only around a collective: a restore by one process
    alone (host arrays, nothing replicated over processes) returns at once."""
    run = _run("_mp_workers:primary_restores_alone", 2, args={"directory": str(tmp_path)})
    result = run.check().procs[0].result
    assert result["w_ok"] and result["restore_s"] < 10, result


def test_serving_processes_read_one_step_while_another_lands(tmp_path):
    """``restore_params`` with a like sharded over the processes: a process that lists
    the directory before a new step lands reads the primary's latest step, not its own
    (was: one process served step 1's shards and the other step 2's, without an error)."""
    run = _run("_mp_workers:serving_while_a_step_lands", 2, args={"directory": str(tmp_path)})
    assert [p.result["held"] for p in run.check().procs] == [[2], [2]]


def test_serving_onto_the_abstract_mesh_of_set_mesh(tmp_path):
    """A like on an AbstractMesh, read inside jax.set_mesh (was: jax's raw 'is_fully_
    addressable is not implemented for AbstractMesh' before the read, with 2 processes)."""
    run = _run("_mp_workers:serving_onto_an_abstract_mesh", 2, args={"directory": str(tmp_path)})
    assert [p.result["held"] for p in run.check().procs] == [[1], [1]]


def test_manager_on_s3_process_killed_mid_save(s3_location):
    """Through the manager, on a bucket: process 1 of 3 dies while writing step 2."""
    loc = s3_location.join("run")
    run = _run(
        "_mp_workers:manager_save_killed",
        3,
        args={"directory": loc.spec, "victim_after_opens": 1},
        kill=Kill(process=1, at="mid_save"),
        env={"FOP_COORDINATION_TIMEOUT_S": "5", "FOP_PEER_SILENT_S": "3", **s3_location.env},
        heartbeat_timeout_s=60,
        done_timeout_s=2,
    )
    assert run[1].killed
    for p in (run[0], run[2]):
        assert p.record.get("ok"), p.describe()
        assert p.result["steps_before"] == [1]
        assert p.result["save2_type"] == "CoordinationError", p.result
        assert p.result["save2_s"] < 5 + 10
        assert "from process 1" in p.result["save2"]  # the missing process, named
    # The primary removed what step 2 had written (a write of the dead process still in
    # flight may land afterwards: debris without a manifest, never a step).
    assert "2/_CHECKPOINT.json" not in set(loc.keys())
    with fop.CheckpointManager(loc.spec, read_only=True) as reader:
        assert reader.steps() == [1]
        np.testing.assert_array_equal(reader.restore()["params"]["w"], W.expected_w(6) + 1)
    with fop.CheckpointManager(loc.spec) as writer:  # a new writer clears the debris
        assert writer.steps() == [1]
    assert {k.split("/")[0] for k in loc.keys()} == {"1", "_RUN.json"}


# ------------------------------------------------------------------ one process fails


@pytest.mark.parametrize("victim", [1, 0], ids=["process-1", "the-primary"])
def test_a_failure_inside_each_collective_operation_reaches_every_process_at_once(tmp_path, victim):
    """One process fails inside each collective operation in turn (a fault point before its
    first coordination call there, or a bad input of its own: a state holding a leaf it
    cannot save, a ``like`` of the wrong shape): every process raises within seconds, the
    others naming that process and its error (was: they waited out the coordination
    timeout, 120 s here, longer than this launch may take, and met at mismatched
    barriers afterwards). One launch covers every operation: after each failure the
    processes meet again on the same names."""
    import _failure_workers as F

    names = list(F.FAULTS)
    run = _run(
        "_failure_workers:one_fails_in_each",
        2,
        args={"directory": str(tmp_path), "names": names, "victim": victim},
        env={"FOP_COORDINATION_TIMEOUT_S": "120"},
        heartbeat_timeout_s=100,
        timeout_s=100,
    ).check()
    failed, other = run.procs[victim].result, run.procs[1 - victim].result
    for mine, theirs in zip(failed, other, strict=True):
        name = mine["name"]
        assert mine["error"] != "returned" and theirs["error"] != "returned", (mine, theirs)
        if F.FAULTS[name] is not None:
            assert "injected fault at collective-" in mine["error"], mine
        if "passed different likes" in theirs["error"]:  # a like of its own: the read's
            assert mine["error"] == theirs["error"], (mine, theirs)  # agreement, on both
        else:
            assert f"process {victim} failed" in theirs["error"], (name, theirs["error"])
            assert mine["error"].split(":")[0] in theirs["error"], (mine, theirs)
        spread = max(mine["t_raised"], theirs["t_raised"]) - mine["t0"]
        assert spread < 15, (name, spread, mine, theirs)


@pytest.mark.parametrize("store, victim", [("s3", 0), ("gcs", 1)])
def test_a_failure_inside_collective_operations_on_an_object_store(store, victim, request):
    """The same on a bucket (the primary's look at the target is one more wait there):
    a manager's open, save (a fault, and a state it cannot save) and restore, fop.save
    and fop.restore, the primary (S3) or process 1 (GCS) failing in each; every process
    raises within seconds, naming it."""
    loc = request.getfixturevalue(f"{store}_location").join("failing")
    names = ["manager-open", "manager-save", "manager-save-bad-state", "manager-restore"]
    names += ["save", "restore"]
    run = _run(
        "_failure_workers:one_fails_in_each",
        2,
        args={"directory": loc.spec, "names": names, "victim": victim},
        env={"FOP_COORDINATION_TIMEOUT_S": "120", **loc.env},
        timeout_s=100,
    ).check()
    failed, other = run.procs[victim].result, run.procs[1 - victim].result
    for mine, theirs in zip(failed, other, strict=True):
        assert mine["error"] != "returned", mine
        assert f"process {victim} failed" in theirs["error"], (mine["name"], theirs["error"])
        assert max(mine["t_raised"], theirs["t_raised"]) - mine["t0"] < 15, (mine, theirs)


@pytest.mark.parametrize(
    "differ, words",
    [
        ("step", r"read different checkpoints \('.*/2/params' on process 0; '.*/1/params' on"),
        ("dtype", r"different likes: the first leaf that differs is \"w .* float32 .*bfloat16"),
        ("spec", r"different likes: .*P\('data',\)\" on process 0 and \"w .* P\(\)\" on process 1"),
    ],
)
def test_a_collective_restore_that_differs_between_processes_is_refused_on_each(
    tmp_path, differ, words
):
    """A step, dtype or sharding of one process's own made one global array of two
    steps (or two dtypes) without an error: every process now raises, naming it."""
    run = _run(
        "_mp_workers:restores_that_differ", 2, args={"directory": str(tmp_path), "differ": differ}
    )
    for proc in run.check().procs:
        assert proc.result["raised"] is not None and re.search(words, proc.result["raised"])
        assert proc.result["after_s"] < 10


def test_a_small_host_value_that_differs_between_processes_is_refused(tmp_path):
    """A learning rate (a Python float) of 0.1 on process 0 and 0.2 on process 1: the
    primary's was saved and every process restored 0.1. Now the save is refused on
    every process, naming the leaf."""
    run = _run("_mp_workers:host_leaf_that_differs", 2, args={"directory": str(tmp_path / "c")})
    procs = run.check().procs
    for proc in procs:
        assert proc.result["raised"] is not None and "disagree" in proc.result["raised"]
    for proc in procs:
        assert "the first leaf that differs: 'params/lr" in proc.result["raised"], proc.result
    assert not (tmp_path / "c").exists()
