"""Liveness by progress: a slow process is waited for and named, a dead one found in seconds.

Real JAX processes on 127.0.0.1 (``tests/support/_multiprocess.py``, gloo). The old rule
was one fixed timeout (``FOP_COORDINATION_TIMEOUT_S``, 300 s) for every wait: it both
waited that long for a dead process and aborted a live one slower than that. Here that
timeout is scaled down to 1.5 s and processes are slowed well past it (the package's
``FOP_PAUSE_AT`` pause points, set in that process only) inside a save's write and a
restore's read: nothing is aborted, and the waiting processes log which process is
late and what it is doing (``FOP_LATE_REPORT_S``). A process SIGKILLed mid-save is named
dead within ``FOP_PEER_SILENT_S``: tests/end_to_end/test_distributed.py
(``test_sigkill_mid_save_survivors_fail_naming_the_missing_process``, 3 processes, the
timeout at 120 s) and ``benchmarks/bench_liveness.py`` (2 and 4 processes).
"""

import os
import re
import time

import _mp_workers as W
import numpy as np
import pytest
from _multiprocess import run_processes

import flax_orbax_plugin as fop

pytestmark = pytest.mark.distributed

SLOW_S = 4.0  # a slowed process's pause: more than twice the scaled-down timeout
ENV = {"FOP_COORDINATION_TIMEOUT_S": "1.5", "FOP_LATE_REPORT_S": "1", "FOP_PEER_SILENT_S": "4"}


def slow_save_and_restore(ctx, directory, slow):
    """Every process saves step 1 through a manager and restores it; ``slow`` maps a
    process to the pause point it stops SLOW_S at (its own environment only)."""
    phase = slow.get(str(ctx.process_id))
    if phase is not None:
        os.environ.update(FOP_PAUSE_AT=phase, FOP_PAUSE_S=str(SLOW_S))
    out = {}
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        state = W.make_state(ctx, 1)
        t = time.monotonic()
        mngr.save(1, state)
        mngr.wait()
        out["save_s"] = time.monotonic() - t
        t = time.monotonic()
        restored = mngr.restore(like=state)
        out["restore_s"] = time.monotonic() - t
    out["restored_exact"] = bool(
        np.array_equal(
            np.asarray(restored["params"]["w"].addressable_shards[0].data),
            np.asarray(state["params"]["w"].addressable_shards[0].data),
        )
    )
    out["steps"] = fop.CheckpointManager(directory, read_only=True).steps()
    return out


def mutual_wait(ctx):
    """Each process waits at a barrier of its own name: both live, neither ever arrives."""
    from flax_orbax_plugin._base import distributed as _distributed

    t = time.monotonic()
    try:
        _distributed.barrier(f"fop/test/mutual-{ctx.process_id}")
        return {"error": None}
    except fop.CoordinationError as e:
        return {"error": str(e), "s": time.monotonic() - t}


@pytest.mark.parametrize(
    ("n", "slow"),
    [(2, {1: "mid_write"}), (4, {2: "mid_write", 3: "mid_read"})],
    ids=["2-processes-one-slow-write", "4-processes-a-slow-write-and-a-slow-read"],
)
def test_a_slow_process_is_waited_for_and_named_never_aborted(tmp_path, n, slow):
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
        assert p.ok, stories
        assert p.result["steps"] == [1] and p.result["restored_exact"], stories
    old_timeout = float(ENV["FOP_COORDINATION_TIMEOUT_S"])
    for victim, phase in slow.items():
        op, waited = ("restore", "restore_s") if phase == "mid_read" else ("save", "save_s")
        assert run[victim].result[waited] >= SLOW_S, stories  # the pause really happened
        # Named late, or behind a late one (the primary waits for it, the others for
        # the primary's outcome).
        late = re.compile(
            rf"late: .*process {victim} \(alive, beat [0-9.]+s ago, doing manager-{op}"
        )
        for p in run.procs:
            if p.process_id not in slow:
                # Waited past the old timeout, and said who it waited for, and why.
                assert p.result[waited] > 2 * old_timeout, stories
                assert late.search(p.stderr), p.describe()
        what = "reading" if phase == "mid_read" else "writing this process's data"
        assert any(what in p.stderr and "MiB left" in p.stderr for p in run.procs), stories


def test_two_processes_waiting_only_for_each_other_fail_after_the_timeout(tmp_path):
    """The one case a fixed limit still ends: both live, each only waiting for the other
    (different paths): CoordinationError on both after FOP_COORDINATION_TIMEOUT_S (2 s)."""
    run = run_processes(
        "test_liveness:mutual_wait",
        2,
        env={"FOP_COORDINATION_TIMEOUT_S": "2", "FOP_PEER_SILENT_S": "4"},
        heartbeat_timeout_s=60,
        timeout_s=90,
        done_timeout_s=2,
    )
    for p in run.procs:
        assert p.ok, p.describe()
        error = p.result["error"]
        assert error and "have only waited for each other" in error, error
        assert 2 <= p.result["s"] < 2 + 10, p.result
