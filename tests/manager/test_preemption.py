"""Preemption with several real JAX processes and real signals (issue 23).

Each test starts 2 (or 4) ``jax.distributed`` processes on 127.0.0.1 running
``_mp_workers.preempted_training``: a loop of ~0.1 s steps with a cross-process
all-reduce, saving every 5 steps with ``handle_sigterm=True`` through the manager or
the callback. The parent sends real SIGTERMs (``_multiprocess.Signal``) when a chosen
process has finished a chosen step: to every process at once, staggered by a step in
both orders, to one non-primary, to the primary only. jax's preemption sync manager
(whose notifier the manager keeps) agrees on one step; every process saves it, waits
for its commit and exits 143. What each test checks:

* every process exits 143, within a few seconds of the first signal (a grace period
  is ~30 s), having saved the same step, which is after the step at the first signal;
* that step is committed and is the latest; it restores bit-exact (int32 state whose
  values depend on every step: a step off by one would not match);
* one run restarts from it (``resume=True``) in two new processes, bit-exact;
* with jax's preemption service off, ``handle_sigterm=True`` is refused at open on
  every process, saying what to set.

Also with several processes (issue 23): the callback's steps never enter a barrier
(the step after a save does not wait for its commit), and a writer on a local path
that is a directory per host is refused at open on every process.
"""

import os

import _mp_workers as W
import numpy as np
import pytest
from _multiprocess import Signal, run_processes

import flax_orbax_plugin as fop

pytestmark = pytest.mark.distributed

AT = 6  # the first signal goes out once its process has finished this step
ENV = {"FOP_COORDINATION_TIMEOUT_S": "20"}
EXIT_WITHIN_S = 10.0  # after the first signal; a scheduler's grace period is ~30 s

# Who is signalled, in order: the first when it finished step AT, the next one step later.
PATTERNS = {
    "all-at-once": [(0, 0), (1, 0)],
    "staggered-0-first": [(0, 0), (1, 1)],
    "staggered-1-first": [(1, 0), (0, 1)],
    "non-primary-only": [(1, 0)],
    "primary-only": [(0, 0)],
}


def _preempt(tmp_path, via, pattern, n=2, **args):
    workdir = str(tmp_path / "job")
    directory = str(tmp_path / "ckpt")
    signals = [
        Signal(p, lambda p=p, late=late: W.progress(workdir, p) >= AT + late) for p, late in pattern
    ]
    run = run_processes(
        "_mp_workers:preempted_training",
        n,
        devices_per_process=2 if n == 2 else 1,
        args={"directory": directory, "via": via, **args},
        workdir=workdir,
        signals=signals,
        env=ENV,
        heartbeat_timeout_s=30,
        timeout_s=60,
    )
    return run, directory


def _check_one_agreed_step(run, directory, n_devices):
    stories = "\n\n".join(p.describe() for p in run.procs)
    assert run.signals_sent, stories
    assert [p.returncode for p in run.procs] == [143] * len(run.procs), stories
    assert all(p.record.get("mode") == "jax" for p in run.procs), stories
    saved = {p.record["last_step"] for p in run.procs}
    assert len(saved) == 1, stories
    step = saved.pop()
    assert step > AT, stories  # after the step the first signal came at
    first_signal = min(t for _, t in run.signals_sent)
    assert max(p.wall_s for p in run.procs) - first_signal < EXIT_WITHIN_S, stories
    mngr = fop.CheckpointManager(directory, read_only=True)
    assert mngr.latest_step() == step
    restored = mngr.restore(step=step)
    want = W.preempt_expected(step, n_devices)
    assert restored["params"]["w"].dtype == np.int32
    assert np.array_equal(restored["params"]["w"], want["w"])
    assert int(restored["params"]["b"]) == step
    return step


# Every pattern through the manager (where the agreement lives); through the callback (a
# loop of on_step_end calls into that manager) the patterns that differ for the loop: all
# at once, the primary first or alone, a non-primary first. A non-primary alone through
# the callback is test_four_processes_one_signalled_then_a_restart_resumes_bit_exact.
CASES = [
    pytest.param(pattern, via, id=f"{pattern}-{via}")
    for pattern in PATTERNS
    for via in ("manager", "callback")
    if via == "manager" or pattern in ("all-at-once", "staggered-1-first", "primary-only")
]


@pytest.mark.parametrize(("pattern", "via"), CASES)
def test_every_process_saves_one_agreed_step_and_exits_143(tmp_path, via, pattern):
    run, directory = _preempt(tmp_path, via, PATTERNS[pattern])
    _check_one_agreed_step(run, directory, n_devices=4)


def test_four_processes_one_signalled_then_a_restart_resumes_bit_exact(tmp_path):
    run, directory = _preempt(tmp_path, "callback", [(2, 0)], n=4)
    step = _check_one_agreed_step(run, directory, n_devices=4)
    # Two new processes (another process count, the same 4 devices) resume from it.
    again = run_processes(
        "_mp_workers:preempted_training",
        2,
        devices_per_process=2,
        args={"directory": directory, "via": "callback", "resume": True, "steps": step + 3},
        workdir=str(tmp_path / "restart"),
        env=ENV,
        heartbeat_timeout_s=30,
        timeout_s=60,
    ).check()
    for p in again.procs:
        assert p.record["resumed"] == step
        assert p.record["resumed_exact"] is True
    assert fop.CheckpointManager(directory, read_only=True).latest_step() == step + 3


def test_without_jax_preemption_service_handle_sigterm_is_refused_at_open(tmp_path):
    run = run_processes(
        "_mp_workers:sigterm_without_preemption_service",
        2,
        devices_per_process=1,
        args={"directory": str(tmp_path / "ckpt")},
        env={**ENV, "JAX_ENABLE_PREEMPTION_SERVICE": "false"},
        timeout_s=60,
    ).check()
    for p in run.procs:
        assert "jax_enable_preemption_service" in p.result["error"]
        assert "handle_sigterm=False" in p.result["error"]
    assert (
        not os.path.exists(tmp_path / "ckpt")  # a refused open leaves nothing it made
        or not os.listdir(tmp_path / "ckpt")
        or fop.CheckpointManager(str(tmp_path / "ckpt"), read_only=True).steps() == []
    )


def test_callback_steps_with_several_processes_never_wait_at_a_barrier(tmp_path):
    """The step after a save does not wait for its commit: no on_step_end enters a
    barrier (each process polls its own save; the collective wait is at the end)."""
    run = run_processes(
        "_mp_workers:callback_step_times",
        2,
        devices_per_process=2,
        args={"directory": str(tmp_path / "ckpt"), "steps": 16, "rows": 256},
        env=ENV,
        timeout_s=60,
    ).check()
    for p in run.procs:
        assert p.result["saved"] == [5, 10, 15]
        assert p.result["barriers"] == [0] * 16
        assert p.result["reported"] == [5, 10, 15, 16]  # every save's figures, in order


@pytest.mark.parametrize("case", ["shared", "missing", "empty"])
def test_per_host_local_directories_are_refused_at_open_on_every_process(tmp_path, case):
    """Each process on its own directory (process 1's absent, or present and empty, as
    on a host with its own disk) is refused on both with one error naming process 1;
    one shared directory opens."""
    base = tmp_path / "ckpt"
    if case == "empty":
        (base / "host1").mkdir(parents=True)
    run = run_processes(
        "_mp_workers:per_host_directories",
        2,
        devices_per_process=1,
        args={"base": str(base), "shared": case == "shared"},
        env=ENV,
        timeout_s=60,
    ).check()
    errors = [p.result["error"] for p in run.procs]
    if case == "shared":
        assert errors == [None, None]
    else:
        assert errors[0] == errors[1]  # the same verdict everywhere
        found = "the directory does not exist" if case == "missing" else "the file is missing"
        assert "process 1 on host" in errors[0] and found in errors[0]
        assert "object store" in errors[0] and "filesystem every host mounts" in errors[0]
    # The primary's check file is gone either way.
    assert [n for n in run[0].result["left"] or [] if n.startswith(".fop-visible-")] == []
