"""Liveness by progress: a slow process is waited for and named, a stalled one named.

Real JAX processes on 127.0.0.1 (``tests/support/_multiprocess.py``, gloo). The old rule
was one fixed timeout for every wait: it both waited that long for a dead process and
aborted a live one slower than that. Now the timeout is a stall timeout (the manager's
``stall_timeout=``, here 3 s): a process is given as long as it makes progress. A slowed
process (``FOP_SLOW_AT``: every region it writes, or every read it completes, sleeps
``FOP_SLOW_S``, set in that process only) takes well past 3 s in total while still
progressing: nothing is aborted, and the waiting processes log which process is late,
what it is doing and its bytes left (``FOP_LATE_REPORT_S``). A process paused past the
stall timeout without progress (``FOP_PAUSE_AT``) is named stalled on the other. A
process SIGKILLed mid-save is named dead within ``FOP_PEER_SILENT_S``:
tests/end_to_end/test_distributed.py
(``test_sigkill_mid_save_survivors_fail_naming_the_missing_process``) and
``benchmarks/bench_liveness.py`` (detection latency, 2 and 4 processes).
"""

import os
import re
import time

import _mp_workers as W
import numpy as np
import pytest
from _multiprocess import Kill, run_processes

import flax_orbax_plugin as fop

pytestmark = pytest.mark.distributed

STALL_S = 3.0  # the manager's stall_timeout= in these runs
SLOW_S = 0.75  # a slowed process's sleep per region written / read completed
# Sharded leaves: 2 regions each per process (2 devices): 6 x 0.75 s = 4.5 s, at least
# 1.5 times the stall timeout by the sleeps alone.
LEAVES = 3
# A stalled process's pause: it is named stalled about 3 s into it (the stall timeout;
# a wait's first look at the heartbeat is at once), its save ~5 s in, < PAUSE_S - 2.
PAUSE_S = 9
ENV = {"FOP_LATE_REPORT_S": "1", "FOP_PEER_SILENT_S": "4"}


def _state(ctx):
    """LEAVES sharded arrays (512 KiB per device shard)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    full = W.expected_w(len(ctx.devices))
    sharding = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    return {
        "params": {
            f"w{i}": jax.make_array_from_callback(full.shape, sharding, lambda x, i=i: full[x] + i)
            for i in range(LEAVES)
        }
    }


def slow_save_and_restore(ctx, directory, slow, pause=None):
    """Every process saves step 1 through a manager (stall_timeout=STALL_S) and restores
    it; ``slow`` maps a process to the slow point it is slowed at (its own environment
    only); ``pause``: [process, pause point, seconds] it stops at without progress."""
    phase = slow.get(str(ctx.process_id))
    if phase is not None:
        os.environ.update(FOP_SLOW_AT=phase, FOP_SLOW_S=str(SLOW_S))
    if pause is not None and pause[0] == ctx.process_id:
        os.environ.update(FOP_PAUSE_AT=pause[1], FOP_PAUSE_S=str(pause[2]))
    out = {}
    state = _state(ctx)
    t = time.monotonic()
    try:
        with fop.CheckpointManager(directory, async_save=False, stall_timeout=STALL_S) as mngr:
            try:
                mngr.save(1, state)
            finally:  # (a failed save's close waits once more)
                out["save_s"] = time.monotonic() - t
            t = time.monotonic()
            restored = mngr.restore(like=state)
            out["restore_s"] = time.monotonic() - t
    except fop.CheckpointError as e:
        return {"error": f"{type(e).__name__}: {e}", "save_s": out.get("save_s")}
    out["restored_exact"] = all(
        np.array_equal(np.asarray(r.data), np.asarray(s.data))
        for name in state["params"]
        for r, s in zip(
            restored["params"][name].addressable_shards,
            state["params"][name].addressable_shards,
            strict=True,
        )
    )
    out["steps"] = fop.CheckpointManager(directory, read_only=True).steps()
    return out


def mutual_wait(ctx):
    """Each process waits at a barrier of its own name: both live, neither ever arrives.
    They meet first, so that both reach their waits together on a loaded machine."""
    from flax_orbax_plugin._base import distributed as _distributed

    _distributed.Region("test").barrier("fop/test/mutual-met")
    t = time.monotonic()
    try:
        _distributed.Region("test").barrier(f"fop/test/mutual-{ctx.process_id}")
        return {"error": None}
    except fop.CoordinationError as e:
        return {"error": str(e), "s": time.monotonic() - t}


def one_sided_save(ctx, directory):
    """Both meet once (so both beat), then only process 0 saves (a collective call);
    process 1 goes on with something else (alive, beating, never in the library) until
    process 0's call has failed (its result written), 6 s at most."""
    from flax_orbax_plugin._base import distributed as _distributed

    _distributed.Region("test").barrier("fop/test/met")
    if ctx.process_id == 1:
        primary_done = os.path.join(ctx.job["workdir"], "result_0.json")
        end = time.monotonic() + 6
        while time.monotonic() < end and not os.path.exists(primary_done):
            time.sleep(0.05)
        return {"error": None}
    t = time.monotonic()
    try:
        fop.save(os.path.join(directory, "ckpt"), {"w": np.ones(3)})
        return {"error": None}
    except fop.CoordinationError as e:
        return {"error": str(e), "s": time.monotonic() - t}


def waits_on_a_dead_process(ctx, waits):
    """Both meet (so both beat); process 1 is SIGKILLed; process 0 then waits for it at
    ``waits`` barriers in turn, each timed."""
    from flax_orbax_plugin._base import distributed as _distributed

    _distributed.Region("test").barrier("fop/test/dead-met")
    ctx.point("met")  # process 1 dies here (Kill)
    out = []
    for i in range(waits):
        t = time.monotonic()
        try:
            _distributed.Region("test").barrier(f"fop/test/dead-{i}")
            out.append({"error": None, "s": time.monotonic() - t})
        except fop.CoordinationError as e:
            out.append({"error": str(e), "s": time.monotonic() - t})
    return out


def test_a_process_named_dead_stays_dead_for_the_next_waits(tmp_path):
    """Process 1 is SIGKILLed: process 0's first wait names it dead once it was silent
    FOP_PEER_SILENT_S (3 s); each later wait on it in that process raises at its first
    look, saying so, rather than waiting out the silence once more (was: 3 s each)."""
    silent = 3.0
    run = run_processes(
        "test_liveness:waits_on_a_dead_process",
        2,
        args={"waits": 3},
        kill=Kill(process=1, at="met"),
        env={"FOP_COORDINATION_TIMEOUT_S": "60", "FOP_PEER_SILENT_S": str(silent)},
        heartbeat_timeout_s=60,
        timeout_s=60,
        done_timeout_s=2,
    )
    assert run[1].killed, run[1].describe()
    assert run[0].ok, run[0].describe()
    first, *later = run[0].result
    assert "process 1 is dead: its heartbeat stopped" in first["error"], first
    assert silent <= first["s"] < silent + 10, first
    for wait in later:
        assert "process 1 is dead: its heartbeat stopped" in wait["error"], wait
        assert "named dead by an earlier wait" in wait["error"], wait
        assert wait["s"] < silent / 2, (first, later)  # at its first look, not after 3 s


def test_a_collective_call_made_by_one_process_only_says_so(tmp_path):
    """The other process is alive and doing nothing of the library's: after the stall
    timeout the caller is told that it has not made the call, not that it stalled."""
    run = run_processes(
        "test_liveness:one_sided_save",
        2,
        args={"directory": str(tmp_path)},
        env={"FOP_COORDINATION_TIMEOUT_S": "2", "FOP_PEER_SILENT_S": "8"},
        heartbeat_timeout_s=60,
        timeout_s=90,
        done_timeout_s=10,
    )
    assert run[0].result is not None, run[0].describe()
    error = run[0].result["error"]
    assert error and "process 1 is alive but has not made this call" in error, run[0].describe()
    assert "on some processes only" in error and "FOP_COORDINATION_TIMEOUT_S=2" in error, error
    assert 2 <= run[0].result["s"] < 6, run[0].result


@pytest.mark.parametrize(
    ("n", "slow"),
    # Four processes: the primary waits for the slow writer, the others for the
    # primary's outcome (a two-process run, one slow writer, is the first of these).
    [(4, {2: "write", 3: "read"})],
    ids=["4-processes-a-slow-write-and-a-slow-read"],
)
def test_a_slow_but_progressing_process_is_named_with_its_bytes_left_never_aborted(
    tmp_path, n, slow
):
    run = run_processes(
        "test_liveness:slow_save_and_restore",
        n,
        args={"directory": str(tmp_path), "slow": {str(p): v for p, v in slow.items()}},
        env=ENV,
        heartbeat_timeout_s=60,
        timeout_s=150,
        done_timeout_s=5,
    )
    stories = "\n\n".join(p.describe() for p in run.procs)
    for p in run.procs:
        assert p.ok and "error" not in p.result, stories
        assert p.result["steps"] == [1] and p.result["restored_exact"], stories
    for victim, phase in slow.items():
        op, waited = ("restore", "restore_s") if phase == "read" else ("save", "save_s")
        # The slowed process itself took well past the stall timeout, in small steps.
        assert run[victim].result[waited] >= 1.5 * STALL_S, stories
        # Named late (by index, with what it does and its bytes left), or behind a late
        # one (the primary waits for it, the others for the primary's outcome).
        what = r"reading \S+" if phase == "read" else "writing this process's data"
        late = re.compile(
            rf"(late|behind them): .*process {victim} \(alive, beat [0-9.]+s ago, doing "
            rf"manager-{op} [^\n]*{what} \([0-9]+ s, [0-9.]+ MiB done, ([0-9.]+) MiB left"
        )
        for p in run.procs:
            if p.process_id not in slow:
                assert p.result[waited] > STALL_S, stories  # waited past the stall timeout
                found = late.findall(p.stderr)
                assert found, p.describe()
                assert any(float(left) > 0 for _, left in found), p.describe()


def test_a_process_that_stops_progressing_is_named_stalled(tmp_path):
    """Process 1 pauses mid-write, beating but moving nothing, past stall_timeout=3 s:
    process 0 (waiting for it in the commit) names it stalled while it is still paused
    (within seconds of the stall timeout, well before the 9 s pause ends), the commit's
    outcome says so on both, and no step is committed."""
    run = run_processes(
        "test_liveness:slow_save_and_restore",
        2,
        args={"directory": str(tmp_path), "slow": {}, "pause": [1, "mid_write", PAUSE_S]},
        env=ENV,
        heartbeat_timeout_s=60,
        timeout_s=120,
        done_timeout_s=30,  # process 1 resumes and fails after process 0
    )
    stories = "\n\n".join(p.describe() for p in run.procs)
    for p in run.procs:
        assert p.ok, stories
        error = p.result["error"]
        assert error.startswith("CoordinationError"), stories
        assert "process 1 is alive but stalled" in error and "stall_timeout=3" in error, error
        assert "writing this process's data" in error and "MiB left" in error, error
    # Both started the save together; process 1 paused at its first region.
    assert STALL_S <= run[0].result["save_s"] < PAUSE_S - 2, stories
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == []


def test_two_processes_waiting_only_for_each_other_fail_after_the_stall_timeout(tmp_path):
    """Both live, each only waiting for the other (different paths): CoordinationError on
    both after the stall timeout (FOP_COORDINATION_TIMEOUT_S, 5 s: no manager here; long
    enough that one process reaching its wait seconds after the other on a loaded
    machine is not judged stalled first)."""
    run = run_processes(
        "test_liveness:mutual_wait",
        2,
        env={"FOP_COORDINATION_TIMEOUT_S": "5", "FOP_PEER_SILENT_S": "8"},
        heartbeat_timeout_s=60,
        timeout_s=90,
        done_timeout_s=2,
    )
    for p in run.procs:
        assert p.ok, p.describe()
        error = p.result["error"]
        assert error and "have only waited for each other" in error, error
        assert "FOP_COORDINATION_TIMEOUT_S" in error, error
        assert 5 <= p.result["s"] < 5 + 10, p.result
