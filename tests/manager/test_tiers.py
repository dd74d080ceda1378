"""Two tiers: steps committed to a local directory, replicated to a persistent one
(the S3 server, the GCS emulator, or another filesystem directory)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import _paths
import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format.layout import MANIFEST_FILE

HERE = os.path.dirname(os.path.abspath(__file__))  # this test module, for child processes

pytest_plugins = ["_servers"]

REPO = _paths.REPO
WAIT_S = 60
# The files of ours at the top of a place that are no step: the run's owner record and,
# on filesystems, the writer lock.
RECORDS = ("_RUN.json", ".writer.lock")


def state(step: int) -> dict:
    """A leaf above the batching threshold (its own array) and batched small ones: a
    step has a dozen files or more."""
    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": rng.standard_normal((512, 640)).astype(np.float32),
            "b": rng.standard_normal((64, 512)).astype(np.float32),
            "small": np.arange(5, dtype=np.int32) + step,
        },
        "opt_state": {"mu": rng.standard_normal((128, 256)).astype(np.float32)},
    }


def make_iterator():
    return fop.StepIndexedIterator(lambda i: i)


def save_steps(mngr, steps, it=None):
    it = it or make_iterator()
    for s in steps:
        next(it)
        mngr.save(s, state(s), data_iterator=it, extras={"loss": 1.0 / s})
    mngr.wait()
    assert mngr.persistent.wait(WAIT_S)


def assert_step(restored, step):
    want = state(step)
    for item in ("params", "opt_state"):
        for k, v in want[item].items():
            np.testing.assert_array_equal(restored[item][k], v)
            assert restored[item][k].dtype == v.dtype


class Remote:
    """A persistent location and a way to look at its raw keys."""

    def __init__(self, url, keys):
        self.url = url
        self.keys = keys


@pytest.fixture(params=["s3", "gcs", "fs"])
def remote(request, tmp_path):
    if request.param == "fs":
        root = tmp_path / "persistent"

        def keys():
            out = []
            for dirpath, _, files in os.walk(root):
                rel = os.path.relpath(dirpath, root)
                out += [f if rel == "." else f"{rel}/{f}" for f in files]
            return sorted(out)

        return Remote(str(root), keys)
    loc = request.getfixturevalue(f"{request.param}_location")
    return Remote(loc.url, loc.keys)


@pytest.fixture
def s3(s3_location):
    return Remote(s3_location.url, s3_location.keys)


def remote_steps(url):
    return fop.CheckpointManager(url, read_only=True).steps()


# ------------------------------------------------------------------ replication


@pytest.mark.parametrize("format_version", [1, 2])
def test_every_item_is_replicated_whole_and_restores_bit_exact(remote, tmp_path, format_version):
    """In both format versions the tier copies the step's files as they are: in version
    2 a few data files per item and process, not one object per chunk."""
    local = tmp_path / "local"
    it = make_iterator()
    options = {"persistent": remote.url, "format_version": format_version}
    with fop.CheckpointManager(local, **options) as mngr:
        save_steps(mngr, [1, 2], it)
        assert mngr.persistent.replicated == [1, 2]
    assert remote_steps(remote.url) == [1, 2]
    # Every file of the local step is there, byte for byte (the manifest included).
    local_files = sorted(
        os.path.relpath(os.path.join(d, f), local / "2")
        for d, _, fs in os.walk(local / "2")
        for f in fs
    )
    assert sorted(k[2:] for k in remote.keys() if k.startswith("2/")) == local_files
    assert "data_iterator/process_0.json" in local_files
    if format_version == 2:  # no chunk files, a data file and its index per item
        assert not [f for f in local_files if "/c/" in f], local_files
        assert {f for f in local_files if "/data/" in f} == {
            "params/data/0-0.bin",
            "params/data/0.json",
            "opt_state/data/0-0.bin",
            "opt_state/data/0.json",
        }
    # The persistent tier alone restores it: arrays, extras, the data position.
    with fop.CheckpointManager(remote.url, read_only=True) as reader:
        it2 = make_iterator()
        restored = reader.restore(data_iterator=it2)
    assert_step(restored, 2)
    assert restored["extras"] == {"loss": 0.5}
    assert next(it2) == next(it)


def test_restart_replicates_committed_local_steps_that_never_were(s3, tmp_path):
    local = tmp_path / "local"
    with fop.CheckpointManager(local) as mngr:  # no persistent tier yet
        save_steps_plain = [mngr.save(s, state(s)) for s in (1, 2, 3)]
        assert all(save_steps_plain)
    with fop.CheckpointManager(local, persistent=fop.Tier(s3.url, keep=2)) as mngr:
        assert mngr.persistent.wait(WAIT_S)
        # Only the newest: older ones would be deleted by the persistent retention at once.
        assert mngr.persistent.replicated == [3]
    assert remote_steps(s3.url) == [3]


KILLED = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    import flax_orbax_plugin as fop
    from test_tiers import state
    with fop.CheckpointManager({local!r}, persistent={url!r}) as m:
        m.save(1, state(1))
        m.wait()
        assert m.persistent.wait(60)
        print("replicated 1", flush=True)
        os.environ["FOP_KILL_AT"] = "mid_replication:4"  # the 4th file of step 2
        m.save(2, state(2), extras={{"loss": 0.5}})
        m.wait()
        m.persistent.wait(60)
    print("not killed", flush=True)
    """
)


def test_kill_during_replication_lists_nothing_partial_and_restart_finishes(remote, tmp_path):
    loc = remote
    local = tmp_path / "local"
    script = KILLED.format(repo=REPO, tests=HERE, local=str(local), url=loc.url)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=_proc.child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert "replicated 1" in proc.stdout and "not killed" not in proc.stdout
    # Step 2 is committed locally; its copy died midway: files there, no manifest.
    assert fop.CheckpointManager(local, read_only=True).steps() == [1, 2]
    partial = [k for k in loc.keys() if k.split("/")[0].startswith("2")]  # 2/ or 2.partial-
    assert partial and f"2/{MANIFEST_FILE}" not in loc.keys()
    assert remote_steps(loc.url) == [1]  # nothing partial is listed
    np.testing.assert_array_equal(
        fop.restore_params(loc.url)["w"], state(1)["params"]["w"]
    )  # and the persistent tier still restores its last whole step
    # The restart removes the dead copy and finishes the job.
    with fop.CheckpointManager(local, persistent=loc.url) as mngr:
        assert mngr.persistent.wait(WAIT_S)
        assert mngr.persistent.replicated == [2]
    assert remote_steps(loc.url) == [1, 2]
    left = [k for k in loc.keys() if not k.startswith(("1/", "2/")) and k not in RECORDS]
    assert not left  # nothing left over
    with fop.CheckpointManager(loc.url, read_only=True) as reader:
        restored = reader.restore()
    assert_step(restored, 2)
    assert restored["extras"] == {"loss": 0.5}


KILLED_COPY_DOWN = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {repo!r})
    import flax_orbax_plugin as fop
    os.environ["FOP_KILL_AT"] = "mid_replication:3"
    with fop.CheckpointManager({local!r}, persistent={url!r}) as m:
        m.restore()
    print("not killed", flush=True)
    """
)


def test_kill_during_copy_down_leaves_no_local_step_and_the_next_start_restores(s3, tmp_path):
    with fop.CheckpointManager(tmp_path / "a", persistent=s3.url) as mngr:
        save_steps(mngr, [1, 2])
    fresh = tmp_path / "fresh"
    script = KILLED_COPY_DOWN.format(repo=REPO, local=str(fresh), url=s3.url)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert any(n.startswith("2.partial-") for n in os.listdir(fresh))
    assert fop.CheckpointManager(fresh, read_only=True).steps() == []
    with fop.CheckpointManager(fresh, persistent=s3.url) as mngr:
        assert_step(mngr.restore(), 2)
    assert sorted(n for n in os.listdir(fresh) if n not in RECORDS) == ["2"]


def test_local_directory_wiped_mid_run(s3, tmp_path):
    local = tmp_path / "local"
    with fop.CheckpointManager(local, persistent=s3.url) as mngr:
        save_steps(mngr, [1, 2])
        shutil.rmtree(local)
        assert mngr.steps() == []
        # Restore takes the newest step of the persistent tier, copied down.
        assert_step(mngr.restore(), 2)
        assert mngr.restored_step == 2 and mngr.steps() == [2]
        # Saving goes on; steps must still increase across both tiers.
        with pytest.raises(fop.CheckpointError, match=r"local \+ s3://.*steps must increase"):
            mngr.save(1, state(1))
        shutil.rmtree(local)
        save_steps(mngr, [3])
        assert mngr.steps() == [3]
    assert remote_steps(s3.url) == [1, 2, 3]


def test_fresh_machine_resumes_from_the_bucket_bit_exact(gcs_location, tmp_path):
    url = gcs_location.url
    it = make_iterator()
    options = {"persistent": url}
    cb = fop.CheckpointCallback(
        str(tmp_path / "machine-a"), every_steps=2, data_iterator=it, manager_options=options
    )
    st = cb.on_train_start(state(0))
    for step in range(1, 6):
        next(it)
        st = state(step)
        cb.on_step_end(step, st)
    cb.on_train_end(st, step=5)  # waits for the replication of the final step
    # The final step is always there; an older one may have been superseded by a newer
    # one while queued (only the newest queued step is copied, as keep_every is unset).
    assert remote_steps(url)[-1] == 5 and set(remote_steps(url)) <= {2, 4, 5}
    # Another machine, empty local disk: resume=True finds the bucket's latest step.
    it_b = make_iterator()
    cb_b = fop.CheckpointCallback(
        str(tmp_path / "machine-b"), every_steps=2, resume="required", manager_options=options
    )
    resumed = cb_b.on_train_start(state(0), data_iterator=it_b)
    assert cb_b.resumed_step == 5
    assert_step(resumed, 5)
    assert next(it_b) == next(it)  # the data position came along
    assert cb_b.manager.steps() == [5]  # copied down to the local tier
    cb_b.close()


def test_resume_false_refuses_a_persistent_tier_holding_steps(s3, tmp_path):
    with fop.CheckpointManager(tmp_path / "a", persistent=s3.url) as mngr:
        save_steps(mngr, [1])
    cb = fop.CheckpointCallback(str(tmp_path / "b"), manager_options={"persistent": s3.url})
    with pytest.raises(fop.CheckpointError, match="already holds steps"):
        cb.on_train_start(state(0))
    cb.close()


@pytest.mark.parametrize("remote", ["s3", "fs"], indirect=True)
def test_a_step_replaced_locally_is_replaced_in_the_persistent_tier(remote, tmp_path):
    with fop.CheckpointManager(tmp_path / "local", persistent=remote.url) as mngr:
        save_steps(mngr, [1, 2])
        mngr.save(2, state(7), overwrite=True)
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
        assert mngr.persistent.replicated == [1, 2, 2]
    assert all(k.startswith(("1/", "2/")) or k in RECORDS for k in remote.keys())  # old one gone
    with fop.CheckpointManager(remote.url, read_only=True) as reader:
        assert reader.steps() == [1, 2]
        assert_step(reader.restore(step=2), 7)
        assert_step(reader.restore(step=1), 1)


# ------------------------------------------------------------------ retention


@pytest.mark.parametrize("remote", ["s3", "fs"], indirect=True)  # GCS: the same code, slower
def test_each_tier_has_its_own_retention(remote, tmp_path):
    local = tmp_path / "local"
    with fop.CheckpointManager(
        local, keep=2, persistent=fop.Tier(remote.url, keep=1, keep_every=3)
    ) as mngr:
        save_steps(mngr, range(1, 8))
        mngr.gc()  # local retention ran while steps were queued for replication
        assert mngr.steps() == [6, 7]
        assert mngr.persistent.steps() == [3, 6, 7]
    assert remote_steps(remote.url) == [3, 6, 7]
    assert not [k for k in remote.keys() if k.split("/")[0] not in ("3", "6", "7", *RECORDS)]


def test_a_failed_replication_is_raised_by_wait_and_close_naming_the_step(tmp_path):
    remote = tmp_path / "persistent"
    remote.mkdir()
    for step in (1, 2):  # a file where each step's directory should be
        (remote / str(step)).write_text("a file where the step should be")
    with pytest.raises(fop.CheckpointError, match=r"persistent path .*: expected a directory"):
        fop.CheckpointManager(tmp_path / "other", persistent=str(remote / "1"))
    mngr = fop.CheckpointManager(tmp_path / "local", persistent=str(remote))
    try:
        mngr.save(1, state(1))
        mngr.wait()
        with pytest.raises(fop.ReplicationError, match=r"step 1 of .*local was not replicated to"):
            mngr.persistent.wait(WAIT_S)
        mngr.save(2, state(2))  # training goes on: the local tier is unaffected
        mngr.wait()
    finally:
        with pytest.raises(fop.ReplicationError, match="step 2 of"):
            mngr.close()
    assert fop.CheckpointManager(tmp_path / "local", read_only=True).steps() == [1, 2]
    for step in (1, 2):  # never written through, nor replaced
        assert (remote / str(step)).read_text() == "a file where the step should be"


def test_local_retention_keeps_the_steps_waiting_for_a_stalled_bucket(tmp_path, monkeypatch):
    """A real S3 server, stopped (SIGSTOP) while steps commit locally: the step being
    copied is kept locally whatever ``keep`` says; a queued step superseded by a newer
    one is not; once the server resumes, everything ends where the policies say."""
    from _s3_server import S3Server

    with S3Server(mode="process") as server:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        spec = server.location(server.create_bucket(), "ckpt").spec
        local = tmp_path / "local"
        mngr = fop.CheckpointManager(local, keep=1, persistent=fop.Tier(spec, keep=1))
        try:
            os.kill(server._proc.pid, signal.SIGSTOP)
            try:
                for s in (1, 2, 3):
                    mngr.save(s, state(s))
                    mngr.wait()  # committed locally, local retention applied
                assert not mngr.persistent.wait(0.5)  # the bucket is stalled
                assert mngr.steps() == [1, 3]  # 1 is being copied; 2 was superseded
            finally:
                os.kill(server._proc.pid, signal.SIGCONT)
            assert mngr.persistent.wait(WAIT_S)
            assert mngr.persistent.replicated == [1, 3]
            assert mngr.gc() == [1]
        finally:
            mngr.close()
        assert fop.CheckpointManager(spec, read_only=True).steps() == [3]


def test_persistent_every_replicates_only_due_steps_and_keeps_them_until_there(
    tmp_path, monkeypatch
):
    """``Tier(every=3)``: steps 3 and 6 reach the persistent path, no other step
    ever does; while the copy of 3 is held back (the replicator yields as to a save
    in flight), local retention (``keep=1``) deletes the steps not due but keeps 3."""
    import threading

    from flax_orbax_plugin._manager.tiers import state as tier_state

    monkeypatch.setattr(tier_state, "MAX_DEFER_S", 600.0)
    remote, local = tmp_path / "persistent", tmp_path / "local"
    seen: set[str] = set()  # every name the persistent path ever held
    hold = threading.Event()
    hold.set()
    with fop.CheckpointManager(local, keep=1, persistent=fop.Tier(str(remote), every=3)) as mngr:
        mngr.persistent._state.busy = hold.is_set
        for s in range(1, 6):
            mngr.save(s, state(s))
            mngr.wait()
            seen |= set(os.listdir(remote)) if remote.exists() else set()
        assert mngr.steps() == [3, 5]  # 1, 2, 4 deleted; 3 waits for the bucket
        assert remote_steps(str(remote)) == []
        hold.clear()
        assert mngr.persistent.wait(WAIT_S)
        for s in (6, 7):
            mngr.save(s, state(s))
            mngr.wait()
            assert mngr.persistent.wait(WAIT_S)
            seen |= set(os.listdir(remote))
        mngr.gc()
        assert mngr.steps() == [7]
        assert mngr.persistent.replicated == [3, 6]
    seen |= set(os.listdir(remote))
    assert {n.split(".")[0] for n in seen if not n.startswith(("_", "."))} == {"3", "6"}
    assert remote_steps(str(remote)) == [3, 6]
    with fop.CheckpointManager(str(remote), read_only=True) as reader:
        for s in (3, 6):
            assert_step(reader.restore(step=s), s)


# ------------------------------------------------------------------ restore choice


def test_a_damaged_local_step_is_restored_from_the_persistent_tier(s3, tmp_path):
    local = tmp_path / "local"
    with fop.CheckpointManager(local, persistent=s3.url) as mngr:
        save_steps(mngr, [1, 2])
        (local / "2" / "extras" / "value.json").write_text('{"loss": 9}')
        restored = mngr.restore()
        assert mngr.restored_step == 2
        assert restored["extras"] == {"loss": 0.5}
        assert_step(restored, 2)
        assert any(n.startswith("2.corrupt-") for n in os.listdir(local))


def test_a_damaged_persistent_copy_is_never_copied_down(s3_location, tmp_path):
    with fop.CheckpointManager(tmp_path / "a", persistent=s3_location.url) as mngr:
        save_steps(mngr, [1, 2])
    s3_location.kvstore().write("2/extras/value.json", b'{"loss": 9}').result()
    with fop.CheckpointManager(tmp_path / "b", persistent=s3_location.url) as mngr:
        restored = mngr.restore()  # step 2 fails its check: step 1 instead
        assert mngr.restored_step == 1
        assert restored["extras"] == {"loss": 1.0}
        assert mngr.steps() == [1]
        # Nothing of step 2 reached the local tier (not even a step set aside).
        assert not [n for n in os.listdir(tmp_path / "b") if n.startswith("2")]
        with pytest.raises(fop.CorruptCheckpointError, match=r"2/extras/value.json: sha256"):
            mngr.restore(step=2)


def test_the_local_copy_wins_when_both_tiers_hold_the_step(s3_location, tmp_path):
    local = tmp_path / "local"
    with fop.CheckpointManager(local, persistent=s3_location.url) as mngr:
        save_steps(mngr, [1])
    # Make the persistent copy differ (validly): if it were read, the value would show.
    manifest = json.loads(s3_location.read(f"1/{MANIFEST_FILE}"))
    assert manifest["step"] == 1
    with fop.CheckpointManager(local, persistent=s3_location.url) as mngr:
        s3_location.delete(f"1/{MANIFEST_FILE}")  # gone remotely: the local step still reads
        assert_step(mngr.restore(), 1)


def test_a_symlink_in_a_local_step_stops_its_copy_and_is_named(s3, tmp_path):
    local = tmp_path / "local"
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    with fop.CheckpointManager(local) as mngr:
        mngr.save(1, state(1))
    os.symlink(outside, local / "1" / "params" / "link")
    with pytest.raises(fop.ReplicationError, match=r"1/params/link: .* found a symbolic link"):
        with fop.CheckpointManager(local, persistent=s3.url) as mngr:
            mngr.persistent.wait(WAIT_S)
    assert [k for k in s3.keys() if k not in RECORDS] == []


# ------------------------------------------------------------------ SIGTERM

PREEMPTED = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {tests!r})
    import flax_orbax_plugin as fop
    from test_tiers import state
    with fop.CheckpointManager({local!r}, every_steps=1000, handle_sigterm=True,
                               persistent=fop.Tier({url!r}, grace_seconds=60)) as m:
        for step in range(1, 100000):
            m.save(step, state(step))
            print(step, flush=True)
            time.sleep(0.01)
    """
)


def test_sigterm_saves_locally_then_replicates_before_exiting(s3, tmp_path):
    local = tmp_path / "local"
    script = PREEMPTED.format(repo=REPO, tests=HERE, local=str(local), url=s3.url)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=_proc.child_env()
    )
    out = _proc.sigterm_after(proc, 3)
    assert proc.returncode == 143
    (step,) = fop.CheckpointManager(local, read_only=True).steps()
    assert step >= 3
    assert remote_steps(s3.url) == [step]
    with fop.CheckpointManager(s3.url, read_only=True) as reader:
        assert_step(reader.restore(), step)
    assert (int(out[-1]) if out else 3) <= step


def test_options_are_checked(tmp_path, s3):
    with pytest.raises(ValueError, match="needs a writer"):
        fop.CheckpointManager(tmp_path, read_only=True, persistent=s3.url)
    with pytest.raises(fop.OptionError, match="is the local directory itself"):
        fop.CheckpointManager(tmp_path / "x", persistent=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="must be a local directory"):
        fop.CheckpointManager(s3.url, persistent=str(tmp_path / "y"))


# ------------------------------------------------------------------ several processes


def mp_tiered(ctx, local, fresh, url):
    """Run in each of 2 real JAX processes: saves through a tiered manager (a sharded
    state), then restores on an empty local directory from the persistent tier."""
    import _mp_workers as W

    with fop.CheckpointManager(local, keep=1, persistent=fop.Tier(url, keep=2)) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, W.make_state(ctx, step), extras={"step": step})
        mngr.wait()
        replicated = mngr.persistent.wait(WAIT_S)
        copied = list(mngr.persistent.replicated)
    with fop.CheckpointManager(fresh, persistent=url) as mngr:
        extras = mngr.restore(items="extras")
        restored_step = mngr.restored_step
        fresh_steps = mngr.steps()
    return {
        "replicated": replicated,
        "copied": copied,
        "extras": extras,
        "restored_step": restored_step,
        "fresh_steps": fresh_steps,
    }


@pytest.mark.distributed
def test_two_processes_replicate_and_resume_from_the_bucket(s3_location, tmp_path):
    import _mp_workers as W
    from _multiprocess import run_processes

    local, fresh = str(tmp_path / "local"), str(tmp_path / "fresh")
    run = run_processes(
        "test_tiers:mp_tiered",
        2,
        devices_per_process=2,
        args={"local": local, "fresh": fresh, "url": s3_location.url},
        env={"FOP_COORDINATION_TIMEOUT_S": "20", **s3_location.env},
        heartbeat_timeout_s=30,
        timeout_s=150,
    ).check()
    primary, other = run[0].result, run[1].result
    assert primary["replicated"] and other["replicated"]
    assert primary["copied"][-1] == 3 and other["copied"] == primary["copied"]
    for r in (primary, other):
        assert r["restored_step"] == 3 and r["extras"] == {"step": 3}
        assert r["fresh_steps"] == [3]
    assert remote_steps(s3_location.url)[-1] == 3
    with fop.CheckpointManager(fresh, read_only=True) as reader:
        host = reader.restore()
    np.testing.assert_array_equal(host["params"]["w"], W.expected_w(4) + 3)
    np.testing.assert_array_equal(host["opt_state"]["mu"], -(W.expected_w(4) + 3))


def step_files(directory, step) -> set[str]:
    """Relative paths of a step's files, the manifest excluded (what is shared out)."""
    root = os.path.join(directory, str(step))
    out = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    return out - {MANIFEST_FILE}


def test_the_partition_of_a_step_is_whole_disjoint_balanced_and_order_free():
    from flax_orbax_plugin._manager.tiers.files import FILE_COST_BYTES
    from flax_orbax_plugin._manager.tiers.files import partition as _partition

    sizes = {"big": 10_000_000, "a/1": 4_000_000, "a/2": 4_000_000, "m.json": 300}
    sizes |= {f"small/{i}": 1000 for i in range(40)}
    shares = _partition(sizes, 2)
    assert _partition(dict(reversed(list(sizes.items()))), 2) == shares  # any order
    assert sorted(shares[0] + shares[1]) == sorted(sizes)  # whole, nothing twice
    assert "big" in shares[0] and {"a/1", "a/2"} <= set(shares[1])  # largest first
    loads = [sum(sizes[f] + FILE_COST_BYTES for f in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= 2_000_000 + FILE_COST_BYTES
    assert _partition({"only": 5}, 3) == [["only"], [], []]


def mp_shares(ctx, local, url):
    """Run in each of 2 processes: saves two steps through a tiered manager; returns
    what this process's replicator copied of each step."""
    import _mp_workers as W

    with fop.CheckpointManager(local, persistent=url) as mngr:
        for step in (1, 2):
            mngr.save(step, W.make_state(ctx, step), extras={"step": step})
            mngr.wait()
            assert mngr.persistent.wait(WAIT_S)
        tier = mngr.persistent
        return {
            "replicated": list(tier.replicated),
            "copied": {str(s): files for s, files in tier.copied_files.items()},
        }


@pytest.mark.distributed
def test_two_processes_each_copy_their_share_and_the_primary_commits(tmp_path):
    import _mp_workers as W
    from _multiprocess import run_processes

    local, remote = str(tmp_path / "local"), str(tmp_path / "persistent")
    run = run_processes(
        "test_tiers:mp_shares",
        2,
        devices_per_process=2,
        args={"local": local, "url": remote},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        heartbeat_timeout_s=30,
        timeout_s=120,
    ).check()
    first, second = run.results
    assert first["replicated"] == second["replicated"] == [1, 2]
    for step in ("1", "2"):
        mine, theirs = set(first["copied"][step]), set(second["copied"][step])
        assert mine and theirs and not mine & theirs  # both copied, nothing twice
        assert mine | theirs == step_files(local, step)  # and together, the whole step
    # Committed by the primary (a filesystem tier: staging renamed), nothing else there.
    assert sorted(n for n in os.listdir(remote) if n not in RECORDS) == ["1", "2"]
    assert step_files(remote, 2) == step_files(local, 2)
    with fop.CheckpointManager(remote, read_only=True) as reader:
        host = reader.restore()
    np.testing.assert_array_equal(host["params"]["w"], W.expected_w(4) + 2)
    np.testing.assert_array_equal(host["opt_state"]["mu"], -(W.expected_w(4) + 2))
    assert host["extras"] == {"step": 2}


def mp_one_share_fails(ctx, local, url):
    """Run in each of 2 processes: step 2's copy fails on process 1 only (every file it
    copies raises an I/O error); then step 3 replicates."""
    import _mp_workers as W

    with fop.CheckpointManager(local, persistent=url) as mngr:
        mngr.save(1, W.make_state(ctx, 1))
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
        if ctx.process_id == 1:
            os.environ["FOP_FAIL_AT"] = "replicate_file"
        mngr.save(2, W.make_state(ctx, 2))
        mngr.wait()
        try:
            mngr.persistent.wait(WAIT_S)
            error = None
        except fop.ReplicationError as e:
            error = str(e)
        after_failure = mngr.persistent.agreed_steps()
        os.environ.pop("FOP_FAIL_AT", None)
        mngr.save(3, W.make_state(ctx, 3))
        mngr.wait()
        replicated = mngr.persistent.wait(WAIT_S)
        copied = list(mngr.persistent.replicated)
    return {
        "error": error,
        "after_failure": after_failure,
        "replicated": replicated,
        "copied": copied,
    }


@pytest.mark.distributed
def test_a_share_failing_on_one_process_commits_nothing_and_every_process_raises(
    s3_location, tmp_path
):
    import _mp_workers as W
    from _multiprocess import run_processes

    local = str(tmp_path / "local")
    run = run_processes(
        "test_tiers:mp_one_share_fails",
        2,
        devices_per_process=2,
        args={"local": local, "url": s3_location.url},
        # The three attempts at step 2 (each failing on process 1) without the pauses
        # between them (0.5 s, then 1 s).
        env={"FOP_COORDINATION_TIMEOUT_S": "20", "FOP_TIER_RETRY_DELAY_S": "0", **s3_location.env},
        heartbeat_timeout_s=30,
        timeout_s=120,
    ).check()
    for r in run.results:  # every process raised the same error, naming process 1
        assert r["error"].startswith(f"step 2 of {local} was not replicated to"), r["error"]
        assert "process 1: InjectedFault: injected fault at replicate_file" in r["error"]
        assert "process 0" not in r["error"]
        assert r["after_failure"] == [1]
        assert r["replicated"] and r["copied"] == [1, 3]
    assert remote_steps(s3_location.url) == [1, 3]
    assert not [k for k in s3_location.keys() if k.startswith("2/")]  # nothing of step 2
    with fop.CheckpointManager(s3_location.url, read_only=True) as reader:
        np.testing.assert_array_equal(reader.restore()["params"]["w"], W.expected_w(4) + 3)


def mp_share_killed(ctx, local, url):
    """Run in each of 2 processes: process 1 is SIGKILLed after copying 2 files of its
    share of step 2; process 0 reports what its tier saw (and does not close: the
    close is collective and its peer is gone)."""
    import _mp_workers as W

    mngr = fop.CheckpointManager(local, persistent=url)
    mngr.save(1, W.make_state(ctx, 1))
    mngr.wait()
    assert mngr.persistent.wait(WAIT_S)
    if ctx.process_id == 1:
        os.environ["FOP_KILL_AT"] = "mid_replication:2"
    mngr.save(2, W.make_state(ctx, 2), extras={"step": 2})
    try:
        mngr.wait()  # its barrier may find process 1 already gone
    except fop.CheckpointError:
        pass
    try:
        mngr.persistent.wait(WAIT_S)
        error = None
    except fop.ReplicationError as e:
        error = str(e)
    return {"error": error, "remote": mngr.persistent.steps()}


@pytest.mark.distributed
def test_a_process_killed_mid_share_leaves_nothing_listed_and_a_restart_finishes(
    s3_location, tmp_path
):
    import _mp_workers as W
    from _multiprocess import run_processes

    local = str(tmp_path / "local")
    run = run_processes(
        "test_tiers:mp_share_killed",
        2,
        devices_per_process=2,
        args={"local": local, "url": s3_location.url},
        env={"FOP_COORDINATION_TIMEOUT_S": "8", "FOP_PEER_SILENT_S": "3", **s3_location.env},
        heartbeat_timeout_s=30,
        timeout_s=120,
        recoverable=True,  # the survivor is not terminated by jax when its peer dies
        done_timeout_s=1,
    )
    assert run[1].returncode == -signal.SIGKILL, run[1].describe()
    assert run[0].ok, run[0].describe()
    error = run[0].result["error"]
    assert error.startswith(f"step 2 of {local} was not replicated"), error
    assert "from process 1" in error  # the primary names the process it lost
    assert "process 1 is dead" in error  # by its silent heartbeat (FOP_PEER_SILENT_S=3)
    assert run[0].result["remote"] == [1]
    assert remote_steps(s3_location.url) == [1]
    assert f"2/{MANIFEST_FILE}" not in s3_location.keys()
    # Step 2 is committed locally; one process, restarted, finishes the job.
    assert fop.CheckpointManager(local, read_only=True).steps() == [1, 2]
    with fop.CheckpointManager(local, persistent=s3_location.url) as mngr:
        assert mngr.persistent.wait(WAIT_S)
        assert mngr.persistent.replicated == [2]
    assert remote_steps(s3_location.url) == [1, 2]
    with fop.CheckpointManager(s3_location.url, read_only=True) as reader:
        host = reader.restore()
    np.testing.assert_array_equal(host["params"]["w"], W.expected_w(4) + 2)
    assert host["extras"] == {"step": 2}


def test_incremental_local_steps_are_replicated_whole(s3, tmp_path):
    """Local steps that hard-link unchanged leaves from the previous one: the bucket
    gets every byte of each step (a step there never depends on another)."""
    local = tmp_path / "local"
    frozen = state(1)["params"]["w"]
    with fop.CheckpointManager(local, incremental=True, persistent=s3.url) as mngr:
        for s in (1, 2):
            st = state(s)
            st["params"]["w"] = frozen  # unchanged: linked, not written, in step 2
            mngr.save(s, st)
            mngr.wait()
            assert mngr.persistent.wait(WAIT_S)
        assert mngr.persistent.replicated == [1, 2]
    linked = [
        os.path.join(d, f)
        for d, _, fs in os.walk(local / "2" / "params")
        for f in fs
        if os.stat(os.path.join(d, f)).st_nlink > 1
    ]
    assert linked  # the local step 2 does reuse step 1's files
    with fop.CheckpointManager(s3.url, keep=1) as bucket:
        bucket.gc()  # drop step 1 remotely: step 2 must stand alone
        assert bucket.steps() == [2]
        restored = bucket.restore()
    np.testing.assert_array_equal(restored["params"]["w"], frozen)
    np.testing.assert_array_equal(restored["params"]["b"], state(2)["params"]["b"])


# ------------------------------------------------------------------ foreign entries, damage


class Store:
    """Raw bytes of a persistent location: a filesystem directory or an object store."""

    def __init__(self, url, root=None, kv=None):
        self.url, self.root, self.kv = url, root, kv

    def write(self, key, data):
        if self.kv is not None:
            self.kv.write(key, data).result()
        else:
            path = os.path.join(self.root, key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

    def read(self, key):
        if self.kv is not None:
            r = self.kv.read(key).result()
            return bytes(r.value) if r.state == "value" else None
        try:
            with open(os.path.join(self.root, key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def keys(self):
        if self.kv is not None:
            return sorted(k.decode() for k in self.kv.list().result())
        out = []
        for dirpath, _, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            out += [f if rel == "." else f"{rel}/{f}" for f in files]
        return sorted(out)


@pytest.fixture(params=["s3", "fs"])
def store(request, tmp_path):
    if request.param == "fs":
        root = tmp_path / "persistent"
        root.mkdir()
        return Store(str(root), root=str(root))
    loc = request.getfixturevalue(f"{request.param}_location")
    return Store(loc.url, kv=loc.kvstore())


FOREIGN = {
    "2024/x.txt": b"a user's notes",
    "007/y.bin": b"\x00\x07 zero-padded, not a step",
    "100/_CHECKPOINT_METADATA": b'{"item_handlers": {"default": "PyTreeCheckpointHandler"}}',
    "100/default/_METADATA": b'{"tree_metadata": {}}',
    "100/default/d/0123abcd": b"orbax array data",
    "200/_CHECKPOINT_METADATA": b'{"item_handlers": null}',
    "5.partial-abc123/notes.txt": b"a staging name, but not ours (no pending marker)",
}


@pytest.mark.parametrize("store", ["s3", "gcs", "fs"], indirect=True)
def test_foreign_entries_in_the_persistent_location_are_left_byte_identical(store, tmp_path):
    """A user's 2024/, a zero-padded 007/, an Orbax run (digits-named steps without our
    manifest) and a staging-named folder not ours: opening, replicating, persistent
    retention and reopening leave every byte of them; a step whose name a foreign
    entry holds is not replicated, and the error names it."""
    for key, data in FOREIGN.items():
        store.write(key, data)
    local = tmp_path / "local"
    with fop.CheckpointManager(local, persistent=fop.Tier(store.url, keep=1)) as mngr:
        save_steps(mngr, [1, 2, 3])
        assert mngr.persistent.steps() == [3]
    with fop.CheckpointManager(local, persistent=fop.Tier(store.url, keep=1)) as mngr:
        mngr.save(100, state(100))  # the Orbax run's step 100 holds that name
        mngr.wait()
        with pytest.raises(fop.ReplicationError, match=r"step 100 .*100: something this library"):
            mngr.persistent.wait(WAIT_S)
        save_steps(mngr, [101])
    for key, data in FOREIGN.items():
        assert store.read(key) == data, key
    ours = {k.split("/")[0] for k in store.keys() if k not in FOREIGN and k not in RECORDS}
    assert ours == {"101"}  # and the retention went on deleting our own steps


def _damage_a_chunk(store, step):
    """Flips the bytes of the largest array file of a persistent step (same length):
    its crc32c fails, every JSON checksum and the manifest still pass."""
    keys = [k for k in store.keys() if k.startswith(f"{step}/params/") and "json" not in k]
    key = max(keys, key=lambda k: len(store.read(k)))
    data = store.read(key)
    store.write(key, bytes(b ^ 0xFF for b in data[:64]) + data[64:])
    return key, store.read(key)


def test_a_damaged_persistent_step_is_verified_set_aside_once_and_never_blocks_a_save(
    store, tmp_path
):
    with fop.CheckpointManager(tmp_path / "a", persistent=store.url) as mngr:
        save_steps(mngr, [1, 2])
    key, damaged = _damage_a_chunk(store, 2)
    b = tmp_path / "b"
    with fop.CheckpointManager(b, persistent=store.url) as mngr:
        assert_step(mngr.restore(), 1)  # step 2 fails verification before its local commit
        assert mngr.restored_step == 1
        assert not [n for n in os.listdir(b) if n.startswith("2")]  # nothing of it locally
        assert mngr.persistent.copied_down == [2, 1]  # step 2 was copied down once
        assert mngr.persistent.steps() == [1]
        with pytest.raises(fop.CheckpointError):
            mngr.restore(step=2)
        assert mngr.persistent.copied_down == [2, 1]  # not copied again in this process
    # The damaged copy is kept for inspection: renamed aside (filesystem) or recorded.
    aside = [k for k in store.keys() if k.startswith("2.corrupt-")]
    if store.root is not None:
        assert any(k.endswith(key[1:]) for k in aside)
    else:
        assert store.read(key) == damaged and store.read("_DAMAGED.json") is not None
    c = tmp_path / "c"  # a restart: step 2 is never copied down again
    with fop.CheckpointManager(c, persistent=store.url) as mngr:
        assert_step(mngr.restore(), 1)
        assert mngr.persistent.copied_down == [1]
        save_steps(mngr, [2])  # the step's number is free: the next save is not blocked
        assert mngr.persistent.replicated == [2]
    with fop.CheckpointManager(tmp_path / "d", persistent=store.url) as mngr:
        assert_step(mngr.restore(), 2)
        assert mngr.persistent.copied_down == [2]
    if store.root is not None:  # the set-aside copy is never removed
        assert [k for k in store.keys() if k.startswith("2.corrupt-")] == aside


def test_an_environmental_error_during_copy_down_raises_and_sets_nothing_aside(
    store, tmp_path, monkeypatch
):
    with fop.CheckpointManager(tmp_path / "a", persistent=store.url) as mngr:
        save_steps(mngr, [1, 2])
    before = {k: store.read(k) for k in store.keys()}
    b = tmp_path / "b"
    with fop.CheckpointManager(b, persistent=store.url) as mngr:
        monkeypatch.setenv("FOP_FAIL_AT", "copy_down_file")
        with pytest.raises(OSError, match="injected fault at copy_down_file"):
            mngr.restore()
        monkeypatch.delenv("FOP_FAIL_AT")
        assert mngr.steps() == [] and not [n for n in os.listdir(b) if n[0].isdigit()]
        after = {k: store.read(k) for k in store.keys()}
        assert {k: v for k, v in after.items() if k != "_RUN.json"} == {
            k: v for k, v in before.items() if k != "_RUN.json"
        }  # nothing set aside, nothing recorded as damaged
        assert_step(mngr.restore(), 2)  # the same step, once the fault is gone


def test_a_pending_marker_beside_a_committed_local_manifest_is_not_replicated(s3, tmp_path):
    """A crash between a commit's manifest and the removal of its pending marker leaves
    both: the step is committed, and the marker is no file of the step to copy."""
    from flax_orbax_plugin._core.ownership import PENDING_FILE

    local = tmp_path / "local"
    with fop.CheckpointManager(local) as mngr:
        mngr.save(1, state(1))
    marker = b'{"library": "flax_orbax_plugin", "kind": "pending", "nonce": "abc"}'
    (local / "1" / PENDING_FILE).write_bytes(marker)
    with fop.CheckpointManager(local, persistent=s3.url) as mngr:
        assert mngr.persistent.wait(WAIT_S)
        assert mngr.persistent.replicated == [1]
        assert PENDING_FILE not in mngr.persistent.copied_files[1]
    assert f"1/{PENDING_FILE}" not in s3.keys() and f"1/{MANIFEST_FILE}" in s3.keys()
    with fop.CheckpointManager(tmp_path / "fresh", persistent=s3.url) as mngr:
        assert_step(mngr.restore(), 1)


@pytest.mark.parametrize("store", ["filesystem", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_step_overwritten_while_it_replicates_is_no_damage(store, tmp_path, request):
    """overwrite=True right after a save: the replicator may read the old manifest and
    the new files. That mix is no damage: close() raises nothing, nothing is set
    aside, and the bucket ends with the new version."""
    for i in range(3):  # the race is likely, not certain: a few rounds
        if store == "s3":
            remote = request.getfixturevalue("s3_location").url + f"/r{i}"
        else:
            remote = str(tmp_path / f"persistent{i}")
        local = tmp_path / f"local{i}"
        mngr = fop.CheckpointManager(local, persistent=remote)
        mngr.save(1, {"params": {"w": np.zeros(3, np.float32)}}, extras={"v": 0})
        mngr.wait()
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}}, extras={"v": 1}, overwrite=True)
        mngr.wait()
        mngr.close()  # raised ReplicationError (CorruptCheckpointError) before
        assert not list(local.glob("*.corrupt-*"))
        with fop.CheckpointManager(remote, read_only=True) as persisted:
            assert persisted.restore(step=1, items="extras") == {"v": 1}


def test_latest_step_is_the_step_restore_reads_from_either_tier(s3, tmp_path):
    """Orbax's idiom ``if mngr.latest_step() is None: start afresh`` started afresh over
    a step of the persistent tier that restore() read: latest_step() looked at the local
    directory alone unless asked. Now both say the same step."""
    with fop.CheckpointManager(tmp_path / "a", persistent=s3.url) as mngr:
        save_steps(mngr, [1, 2])
    with fop.CheckpointManager(tmp_path / "lost", persistent=s3.url) as mngr:  # a new disk
        assert mngr.steps() == [] and mngr.all_steps() == []
        assert mngr.latest_step() == 2
        assert mngr.latest_step(include_persistent=False) is None
        assert_step(mngr.restore(), mngr.latest_step())
