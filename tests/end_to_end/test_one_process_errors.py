"""One process's error reaches the others within seconds, never after their stall
timeout: a bad argument given on one process only (``fop.save(..., bogus=1)``, a
callback's ``keep="x"``) is refused inside the call's collective region, so it is
published there; a program that took part in collective operations announces its end
(``_base/host.py``); a close that fails leaves the run; and a process whose operation
of the same number is another (it met an error at another step) is named at once.

Real JAX processes on 127.0.0.1 (``tests/support/_multiprocess.py``) with a 120 s stall
timeout: each error must come far sooner. Before, each of these waited the stall
timeout (for a process that never published its refusal, never announced its end, or
waited for this one on another path).
"""

from __future__ import annotations

import os
import sys

import _proc
import pytest
from _multiprocess import run_processes

import flax_orbax_plugin as fop

pytestmark = pytest.mark.distributed

STALL_S = 120
ENV = {"FOP_COORDINATION_TIMEOUT_S": str(STALL_S)}
FAST_S = 30  # far below the stall timeout


def _run(target, tmp_path, **args):
    return run_processes(
        target,
        2,
        args={"directory": str(tmp_path), **args},
        env=ENV,
        heartbeat_timeout_s=150,
        timeout_s=100,  # below the stall timeout: a wait that long fails the test
    )


def test_a_bad_argument_on_one_process_reaches_the_other_at_once(tmp_path):
    run = _run("_mp_workers:refused_on_one_process", tmp_path)
    stories = "\n\n".join(p.describe() for p in run.procs)
    run.check()
    mine, others = run[1].result, run[0].result
    for name, words in [
        ("save", "save() got an unexpected keyword argument 'bogus'"),
        ("save_async", "save_async() got an unexpected keyword argument 'bogus'"),
        ("restore", "restore() got an unexpected keyword argument 'bogus'"),
        ("manager.save", "save() got an unexpected keyword argument 'bogus'"),
        ("restore_params", "restore_params() got an unexpected keyword argument 'bogus'"),
        ("callback", "keep must be a positive int or None, found str 'x'"),
    ]:
        assert words in mine[name]["error"], (name, stories)
        error = others[name]["error"]
        assert error is not None and "process 1 failed in" in error, (name, stories)
        assert words in error, (name, stories)
        assert others[name]["s"] < FAST_S, (name, others[name], stories)


def test_an_error_met_at_different_steps_is_named_at_once(tmp_path):
    """Process 1 fails in step 1 after process 0 committed it: it closes while process
    0 saves step 2. Each waited for the other until the stall timeout (twice: the
    save, then process 0's close); now process 0's step 2 fails at once naming
    process 1 and the error it failed with, and its close does not wait either."""
    run = _run("_mp_workers:error_met_at_different_steps", tmp_path)
    stories = "\n\n".join(p.describe() for p in run.procs)
    run.check()
    mine, others = run[1].result, run[0].result
    assert "injected fault at collective-manager-save" in mine["save 1"]["error"], stories
    assert others["save 1"]["error"] is None, stories
    for result in (mine, others):
        for name, took in result.items():
            assert took["s"] < FAST_S, (name, stories)
    # Whichever of the two waits saw the other's path first, process 0 learns that
    # process 1 went elsewhere, and why.
    assert "process 1" in others["save 2"]["error"], stories
    assert "injected fault at collective-manager-save" in others["save 2"]["error"] + str(
        others["close"]["error"]
    ), stories
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == [1]


def _program_end(tmp_path, scenario):
    """Runs ``_ending_programs.py`` in two processes; process 0's output, and both
    processes' for the message of a failed assertion."""
    program = os.path.join(os.path.dirname(__file__), "..", "support", "_ending_programs.py")
    outs = _proc.run_two_programs(
        [sys.executable, program], [str(tmp_path), scenario], {**os.environ, **ENV}, 90
    )
    (out0, err0), (out1, err1) = outs
    return out0, f"process 0:\n{out0}\n{err0[-3000:]}\nprocess 1:\n{out1}\n{err1[-3000:]}"


def test_a_program_that_ends_after_a_collective_restore_is_not_waited_for(tmp_path):
    """Process 1 took part in a restore, never saved, then its program ended with an
    error: it registered no exit hook (only a first save did), so process 0's next
    save waited for it until the stall timeout. Every process that entered a
    collective operation now announces its end."""
    fop.save(tmp_path / "saved", {"w": __import__("numpy").arange(32.0).reshape(8, 4)})
    out, stories = _program_end(tmp_path, "restored-then-raises")
    assert "process 1 left the program with RuntimeError: the loss is NaN on host 1" in out
    assert float(out.split("WAITED ")[1].split()[0]) < FAST_S, stories


def test_a_save_failing_at_exit_still_leaves_the_run(tmp_path):
    """Process 1's last save failed in the background and its program ended without
    closing its manager: the exit hook that waited for that save exited the process
    (status 1) before the manager's leaving ran, so process 0's close waited for it
    until the stall timeout (or jax's shutdown barrier aborted both)."""
    out, stories = _program_end(tmp_path, "save-fails-at-exit")
    assert "ProcessFailedError" in out and "process 1 left the run of" in out, stories
    assert float(out.split("WAITED ")[1].split()[0]) < FAST_S, stories
