"""Each host its own local directory (a manager with ``persistent=``): every process
writes all it holds, commits its own copy, the bucket gets the hosts' parts once, and
restore reads each host's own files (way a), a peer's over jax collectives (way b) or
the bucket (way c). Real processes, separate directories, the moto S3 server as the
bucket (the bytes each restore reads from it are counted by tensorstore's metrics)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format.layout import MANIFEST_FILE
from flax_orbax_plugin._manager import per_host
from flax_orbax_plugin._storage.location import Location

pytest_plugins = ["_servers"]

HERE = os.path.dirname(os.path.abspath(__file__))  # this module, for child processes
WAIT_S = 60


class _Ways(logging.Handler):
    """The restore ways the manager logged."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.ways: list[str] = []
        self.all: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        self.all.append(text)
        for way in ("(way a)", "(way b)", "(way c)"):
            if way in text:
                self.ways.append(way[1:-1])


def _files(directory: str, step: int) -> list[str]:
    root = os.path.join(directory, str(step))
    found = (os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    return sorted(os.path.relpath(p, root) for p in found)


def _wipe(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _bucket_bytes_read() -> int:
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/bytes_read")
    return sum(v.get("value", 0) for m in found for v in m["values"])


def _restore(ctx, local, url, like):
    """Opens a manager on this host's directory, restores, returns (values, way, step,
    bytes read from the bucket)."""
    import jax

    ways = _Ways()
    logger = logging.getLogger("flax_orbax_plugin")
    logger.addHandler(ways)
    logger.setLevel(logging.INFO)
    try:
        with fop.CheckpointManager(local, persistent=url) as mngr:
            before = _bucket_bytes_read()  # the open reads the run's owner record there
            got = mngr.restore(like=like)
            read = _bucket_bytes_read() - before
            step = mngr.restored_step
    finally:
        logger.removeHandler(ways)
    mine = {}
    for item, leaves in got.items():
        for k, v in leaves.items():  # this process's shards, compared by the test
            shards = sorted(v.addressable_shards, key=lambda s: s.device.id)
            mine[f"{item}/{k}"] = [np.asarray(s.data).tolist() for s in shards]
            assert v.sharding == like[item][k].sharding
    jax.block_until_ready(got)
    return {"values": mine, "ways": ways.ways, "step": step, "bucket_read": read}


def _expected(ctx, step, like, make=None):
    import _mp_workers as W

    state = (make or W.make_state)(ctx, step)
    out = {}
    for item, leaves in state.items():
        for k, v in leaves.items():
            host = np.asarray(jax_gather(v))
            shards = sorted(like[item][k].addressable_shards, key=lambda s: s.device.id)
            out[f"{item}/{k}"] = [host[s.index].tolist() for s in shards]
    return out


def jax_gather(v):
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(v, tiled=True)


def _replicated(ctx, step):
    """A state each host holds whole: sharded over its own devices, replicated across
    the hosts (mesh rows are processes)."""
    import _mp_workers as W
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = sorted(ctx.devices, key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(ctx.num_processes, -1), ("replica", "data"))
    full = W.expected_w(len(devices)) + step
    w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("data")), lambda i: full[i])
    b_host = np.full((8,), float(step), np.float32)
    b = jax.make_array_from_callback(b_host.shape, NamedSharding(mesh, P()), lambda i: b_host[i])
    return {"params": {"w": w, "b": b}}


class _PrimaryOnly:
    """A custom checkpointable written as for a shared directory: by process 0 only."""

    kind = "notes"

    def save(self, directory, value):
        import jax

        class Done:
            def wait(self):
                if jax.process_index() == 0:
                    directory.write_bytes("notes.txt", value.encode())

        return Done()

    def restore(self, directory, like):
        return directory.read_bytes("notes.txt").decode()


def _primary_only_refused(ctx, base, url):
    """Each host its own directory: an item written on process 0 only is refused."""
    local = os.path.join(base, f"custom{ctx.process_id}")
    with fop.CheckpointManager(
        local, persistent=url, checkpointables={"notes": _PrimaryOnly()}
    ) as m:
        try:
            m.save(1, {"notes": "hello"})
            m.wait()
            error = None
        except fop.CheckpointError as e:
            error = str(e)
        return {"custom_error": error, "custom_steps": m.steps()}


def _outcome(r, want):
    return {"ways": r["ways"], "step": r["step"], "exact": r["values"] == want}


def _from_peers(ctx, base, url):
    """A replicated state, one host wiped: its copy from the peer (way b), then way a."""
    local = os.path.join(base, f"rep{ctx.process_id}")
    with fop.CheckpointManager(local, persistent=url) as mngr:
        mngr.save(7, _replicated(ctx, 7), extras={"step": 7})
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    ctx.client.wait_at_barrier("wiped-rep", 30_000)
    if ctx.process_id == 1:
        _wipe(local)
    ctx.client.wait_at_barrier("wiped-rep-done", 30_000)
    like = _replicated(ctx, 0)
    want = _expected(ctx, 7, like, _replicated)
    r = _restore(ctx, local, url, like)
    out = {"b": {**_outcome(r, want), "bucket_read": r["bucket_read"]}}
    r = _restore(ctx, local, url, like)
    out["after_b"] = {**_outcome(r, want), "bucket_read": r["bucket_read"]}
    out["b_files"] = _files(local, 7)
    return out


def per_host_run(ctx, base, url, url2):
    """Every case in one job of 2 processes, each on ``base/host<i>``."""
    import _mp_workers as W
    import jax
    from jax.sharding import Mesh, NamedSharding

    local = os.path.join(base, f"host{ctx.process_id}")
    out = {}
    with fop.CheckpointManager(local, keep=2, persistent=url) as mngr:
        out["per_host"] = mngr._book.per_host
        for step in (1, 2, 3):
            mngr.save(step, W.make_state(ctx, step), extras={"step": step})
        mngr.wait()
        out["replicated"] = mngr.persistent.wait(WAIT_S)
        out["shares"] = {str(k): v for k, v in mngr.persistent.copied_files.items()}
    out["local_steps"] = sorted(int(n) for n in os.listdir(local) if n.isdigit())
    out["files"] = _files(local, 3)
    like = W.make_state(ctx, 0)
    want = _expected(ctx, 3, like)
    # (a) every host holds step 3: each reads its own files.
    r = _restore(ctx, local, url, like)
    out["a"] = {"ways": r["ways"], "step": r["step"], "exact": r["values"] == want}
    # One host's directory wiped (a replaced host): every host reads the bucket's step.
    ctx.client.wait_at_barrier("wiped-one", 30_000)
    if ctx.process_id == 1:
        _wipe(local)
    ctx.client.wait_at_barrier("wiped-one-done", 30_000)
    r = _restore(ctx, local, url, like)
    out["one_wiped"] = {**_outcome(r, want), "bucket_read": r["bucket_read"] > 0}
    # The copy down was committed with each host's marker: the next restore reads there.
    r = _restore(ctx, local, url, like)
    out["after_c"] = {"ways": r["ways"], "step": r["step"], "exact": r["values"] == want}
    # A changed mesh (devices in reverse order): host copies do not hold the new
    # shards; the bucket's step, resharded.
    mesh = Mesh(np.array(ctx.devices[::-1]), ctx.mesh.axis_names)
    like2 = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, a.sharding.spec)), like)
    # Make every host hold its own copy again (way a would be possible on the old mesh).
    with fop.CheckpointManager(local, keep=2, persistent=url) as mngr:
        mngr.save(4, W.make_state(ctx, 4), extras={"step": 4})
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    r = _restore(ctx, local, url, like2)
    want4 = _expected(ctx, 4, like2)
    out["mesh"] = {"ways": r["ways"], "step": r["step"], "exact": r["values"] == want4}
    # Every directory wiped: the bucket.
    ctx.client.wait_at_barrier("wiped-all", 30_000)
    _wipe(local)
    r = _restore(ctx, local, url, like)
    out["all_wiped"] = {
        "ways": r["ways"],
        "step": r["step"],
        "exact": r["values"] == _expected(ctx, 4, like),
    }
    out.update(_from_peers(ctx, base, url2))
    out.update(_primary_only_refused(ctx, base, url2 + "-custom"))
    return out


def per_host_own_extras(ctx, base, url):
    """Each process passes its own metrics (its local loss) as extras: the step's one
    manifest holds the primary's, so every host's copy holds the primary's."""
    import _mp_workers as W

    local = os.path.join(base, f"host{ctx.process_id}")
    with fop.CheckpointManager(local, persistent=url) as mngr:
        mngr.save(1, W.make_state(ctx, 1), extras={"loss": 0.5 + ctx.process_id})
        mngr.wait()
        replicated = mngr.persistent.wait(WAIT_S)
    return {
        "replicated": replicated,
        "verified": [r.ok for r in fop.verify(os.path.join(local, "1", "extras"))],
        "extras": fop.restore(os.path.join(local, "1", "extras")),
    }


@pytest.mark.distributed
def test_per_host_extras_are_the_primarys_on_every_host(tmp_path, s3_location):
    """Before: each host wrote its own, the one manifest named one checksum, and every
    host's copy but one failed it (no step replicated, no step restored)."""
    from _multiprocess import run_processes

    run = run_processes(
        "test_per_host:per_host_own_extras",
        2,
        devices_per_process=2,
        args={"base": str(tmp_path / "hosts"), "url": s3_location.url},
        env={"FOP_COORDINATION_TIMEOUT_S": "20", "PYTHONPATH": HERE},
        heartbeat_timeout_s=30,
        timeout_s=150,
    ).check()
    for proc in run.procs:
        r = proc.result
        assert r["replicated"] and all(r["verified"]) and r["extras"] == {"loss": 0.5}, r


@pytest.mark.distributed
def test_per_host_directories_save_replicate_and_restore_by_way(tmp_path, s3_location):
    from _multiprocess import run_processes

    base, url, url2 = str(tmp_path / "hosts"), s3_location.url, s3_location.join("rep").url
    run = run_processes(
        "test_per_host:per_host_run",
        2,
        devices_per_process=2,
        args={"base": base, "url": url, "url2": url2},
        env={"FOP_COORDINATION_TIMEOUT_S": "20", "PYTHONPATH": HERE},
        heartbeat_timeout_s=30,
        timeout_s=150,
    ).check()
    r0, r1 = run[0].result, run[1].result
    for r in (r0, r1):
        assert r["per_host"] and r["replicated"]
        assert r["local_steps"][-2:] == [2, 3]  # 1 too while the bucket lacked a newer
        assert "_HOST.json" in r["files"] and MANIFEST_FILE in r["files"]
        assert r["a"] == {"ways": ["way a"], "step": 3, "exact": True}
        # Fully sharded, no replica across hosts: no peer holds the wiped host's part.
        assert r["one_wiped"] == {"ways": ["way c"], "step": 3, "exact": True, "bucket_read": True}
        assert r["after_c"] == {"ways": ["way a"], "step": 3, "exact": True}
        assert r["mesh"] == {"ways": ["way c"], "step": 4, "exact": True}
        assert r["all_wiped"] == {"ways": ["way c"], "step": 4, "exact": True}
    # Replicated across hosts: the wiped host's copy from its peer, bit-exact, and
    # nothing read from the bucket (its steps are listed from one key listing, no
    # manifest read), as by way (a); the copy is then the host's own (way a).
    for r, read in ((r0, 0), (r1, 0)):
        assert r["b"] == {"ways": ["way b"], "step": 7, "exact": True, "bucket_read": read}
        assert r["after_b"] == {"ways": ["way a"], "step": 7, "exact": True, "bucket_read": read}
    # A custom item only process 0 writes: refused on both, naming it; nothing committed.
    assert "process 1's own directory" in r0["custom_error"] + r1["custom_error"]
    for r in (r0, r1):
        assert "checkpointable 'notes' wrote nothing" in r["custom_error"], r["custom_error"]
        assert r["custom_steps"] == []
    assert r0["b_files"] == r1["b_files"]  # the same files, its marker among them
    # Each host holds its own shards (not the other's) and the replicated leaves.
    assert r0["files"] != r1["files"]
    # The bucket holds each file once: the hosts' shares are disjoint.
    shares = [set(r0["shares"]["3"]), set(r1["shares"]["3"])]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    with fop.CheckpointManager(url, read_only=True) as reader:
        assert reader.steps()[-1] == 4
        assert reader.restore(step=3, items="extras") == {"step": 3}


def _memory_taken(directory: str) -> dict:
    """Bytes of the files under ``directory`` and the memory they take (allocated
    blocks: on tmpfs, the pages they hold), with the number of files."""
    size = taken = files = 0
    for root, _, names in os.walk(directory):
        for name in names:
            st = os.lstat(os.path.join(root, name))
            size, taken, files = size + st.st_size, taken + st.st_blocks * 512, files + 1
    return {"size": size, "taken": taken, "files": files}


def four_hosts_one_wiped(ctx, base, url):
    """4 hosts, a state every host holds whole; host 2's directory wiped."""
    local = os.path.join(base, f"host{ctx.process_id}")
    with fop.CheckpointManager(local, persistent=url) as mngr:
        state = _replicated(ctx, 7)
        mngr.save(7, state, extras={"step": 7})
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    memory = {**_memory_taken(local), "state": sum(int(x.nbytes) for x in state["params"].values())}
    ctx.client.wait_at_barrier("wiped-4", 30_000)
    if ctx.process_id == 2:
        _wipe(local)
    ctx.client.wait_at_barrier("wiped-4-done", 30_000)
    like = _replicated(ctx, 0)
    r = _restore(ctx, local, url, like)
    out = _outcome(r, _expected(ctx, 7, like, _replicated))
    return {**out, "bucket_read": r["bucket_read"], "memory": memory}


@pytest.fixture
def ram_disk():
    """A directory on ``/dev/shm`` (a RAM disk, tmpfs), removed afterwards."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm on this machine")
    path = tempfile.mkdtemp(prefix="fop-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.distributed
def test_four_hosts_one_wiped_restores_from_a_peer(ram_disk, s3_location):
    """4 real processes, each its own directory on a RAM disk (/dev/shm): the wiped
    host gets its copy from a peer over jax collectives (way b) on every host,
    bit-exact; only the primary reads the bucket (its listing). A host's step takes
    the memory of its files, each rounded up to whole pages: the state it holds
    (replicas included) plus its JSON files."""
    from _multiprocess import run_processes

    url = s3_location.join("four").url
    run = run_processes(
        "test_per_host:four_hosts_one_wiped",
        4,
        devices_per_process=1,
        args={"base": os.path.join(ram_disk, "hosts"), "url": url},
        env={"FOP_COORDINATION_TIMEOUT_S": "20", "PYTHONPATH": HERE},
        heartbeat_timeout_s=30,
        timeout_s=120,
    ).check()
    page = os.sysconf("SC_PAGE_SIZE")
    for p in run.procs:  # nothing read from the bucket: its steps come from one listing
        memory = p.result.pop("memory")
        assert p.result == {"ways": ["way b"], "step": 7, "exact": True, "bucket_read": 0}
        assert memory["size"] >= memory["state"] > 0, memory  # every shard it holds
        assert memory["size"] <= memory["taken"] <= memory["size"] + page * memory["files"]


def _preempt_state(ctx, step):
    """The state ``_mp_workers.preempted_training`` holds after ``step`` steps."""
    import _mp_workers as W
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    host = W.preempt_expected(step, len(ctx.devices))
    sharded = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    w = jax.make_array_from_callback(host["w"].shape, sharded, lambda i: host["w"][i])
    b = jax.make_array_from_callback((), NamedSharding(ctx.mesh, P()), lambda i: host["b"])
    return {"params": {"w": w, "b": b}}


def killed_mid_save(ctx, base, url):
    """Step 5 saved (and in the bucket), then process 1 dies mid-write of step 10."""
    import _mp_workers as W

    local = os.path.join(base, f"host{ctx.process_id}")
    out = {}
    mngr = fop.CheckpointManager(local, keep=2, persistent=url)
    mngr.save(5, _preempt_state(ctx, 5))
    mngr.wait()
    out["replicated"] = mngr.persistent.wait(WAIT_S)
    W._kill_mid_write(ctx, 1)
    try:
        mngr.save(10, _preempt_state(ctx, 10))
        mngr.wait()
        out["save"] = "returned"
    except Exception as e:  # noqa: BLE001
        out["save"] = type(e).__name__
    ctx.note("partial_out", out)
    ctx.flush()
    return out


@pytest.mark.distributed
def test_per_host_a_host_killed_mid_save_then_a_sigterm_on_resume(tmp_path, s3_location):
    """A host killed mid-save commits nothing anywhere; the restart resumes from each
    host's own copy, then a SIGTERM on every process: the agreed step is committed on
    every host and in the bucket, bit-exact."""
    import _mp_workers as W
    from _multiprocess import Kill, Signal, run_processes

    base, url = str(tmp_path / "hosts"), s3_location.join("kill").url
    env = {"FOP_COORDINATION_TIMEOUT_S": "5", "PYTHONPATH": HERE}
    run = run_processes(
        "test_per_host:killed_mid_save",
        2,
        devices_per_process=2,
        args={"base": base, "url": url},
        kill=Kill(process=1, at="mid_save"),
        env={**env, "FOP_PEER_SILENT_S": "3"},  # the killed process: named dead in 3 s
        heartbeat_timeout_s=60,
        done_timeout_s=1,  # the survivor's last barrier: its peer is gone
        timeout_s=60,
    )
    assert run[1].killed, run[1].describe()
    survivor = run[0].record.get("partial_out")
    assert survivor == {"replicated": True, "save": "CoordinationError"}, run[0].describe()
    for i in (0, 1):  # nothing half-committed on either host, nor in the bucket
        with fop.CheckpointManager(os.path.join(base, f"host{i}"), read_only=True) as r:
            assert r.steps() == [5]
    with fop.CheckpointManager(url, read_only=True) as r:
        assert r.steps() == [5]
    workdir = str(tmp_path / "resume")
    at = 8
    signals = [Signal(p, lambda p=p: W.progress(workdir, p) >= at) for p in (0, 1)]
    run = run_processes(
        "_mp_workers:preempted_training",
        2,
        devices_per_process=2,
        args={"directory": base, "resume": True, "persistent": url},
        workdir=workdir,
        signals=signals,
        env={**env, "FOP_COORDINATION_TIMEOUT_S": "20"},
        heartbeat_timeout_s=30,
        timeout_s=60,
    )
    stories = "\n\n".join(p.describe() for p in run.procs)
    assert [p.returncode for p in run.procs] == [143, 143], stories
    assert {p.record["resumed"] for p in run.procs} == {5}, stories
    assert all(p.record["resumed_exact"] for p in run.procs), stories
    (step,) = {p.record["last_step"] for p in run.procs}
    assert step > at, stories
    for i in (0, 1):
        with fop.CheckpointManager(os.path.join(base, f"host{i}"), read_only=True) as r:
            assert r.latest_step() == step
    with fop.CheckpointManager(url, read_only=True) as r:
        assert r.latest_step() == step
        got = r.restore(step=step)
    want = W.preempt_expected(step, 4)
    assert np.array_equal(got["params"]["w"], want["w"]) and int(got["params"]["b"]) == step


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b"[" * 100_000, "nested 100000 levels deep"),
        (b'{"format": ' + b"[" * 900 + b"]" * 900 + b"}", "nested 901 levels deep"),
        (b'{"format": "flax_orbax_plugin/host-copy", "step": "1"}', "field step: expected"),
        (b'{"step": 1, "step": 2}', "field 'step': expected once"),
        (b"\xff", "not valid JSON"),
    ],
)
def test_a_malformed_host_marker_is_a_problem_named_never_a_raw_error(tmp_path, raw, problem):
    """A marker read back is parsed within the per-host marker's limits and its fields
    checked: a bad one makes the step not this host's (logged), never a RecursionError
    (raised on one host inside the collective open, it stalled the others)."""
    loc = Location.from_path(str(tmp_path))
    os.makedirs(tmp_path / "1")
    (tmp_path / "1" / per_host.HOST_FILE).write_bytes(raw)
    doc, found = per_host.read_marker(loc, 1)
    assert doc is None and problem in found and per_host.HOST_FILE in found, found
    assert per_host.valid_steps(loc, [1], None) == []
    good = per_host.host_marker(1, "ab" * 16, per_host.COPY_LAYOUT)
    (tmp_path / "1" / per_host.HOST_FILE).write_bytes(good)
    assert per_host.valid_steps(loc, [1], "ab" * 16) == [1]
