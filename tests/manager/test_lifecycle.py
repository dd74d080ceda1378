"""How a manager ends (``_manager/lifecycle.py``): an error that leaves a ``with`` block on
one process reaches the others at once, never after their stall timeout; the save in
flight is kept; a new manager after an error every process shared is not affected.
Real processes (jax.distributed on 127.0.0.1)."""

from __future__ import annotations

import os
import time

import _proc
import pytest
from _multiprocess import run_processes

import flax_orbax_plugin as fop

STALL_S = 60  # each process's stall timeout: the bound an error must beat by far
ENV = {"FOP_COORDINATION_TIMEOUT_S": str(STALL_S)}


def error_in_block(ctx, directory, via, failing):
    """Saves steps 1, 2, ... in a ``with`` block (the manager's or the callback's); at
    step 3 the processes in ``failing`` raise from user code, inside the block."""
    from _mp_workers import replicated_state

    t_raise = None
    opened = (
        fop.CheckpointManager(directory, every_steps=1)
        if via == "manager"
        else fop.CheckpointCallback(directory, every_steps=1)
    )
    try:
        with opened as m:
            for step in range(1, 6):
                if ctx.process_id in failing and step == 3:
                    t_raise = time.time()
                    raise RuntimeError(f"the loss is NaN on host {ctx.process_id}")
                state = replicated_state(ctx, step, rows=8)
                if via == "manager":
                    m.save(step, state)
                else:
                    m.on_step_end(step, state)
    except Exception as e:  # noqa: BLE001  (reported to the test)
        return {"error": f"{type(e).__name__}: {e}", "t_error": time.time(), "t_raise": t_raise}
    return {"error": None}


def shared_error_then_a_new_manager(ctx, directory):
    """Every process raises at step 2 inside the block, catches it outside, opens a new
    manager on the same directory and goes on: step 3 commits."""
    from _mp_workers import replicated_state

    try:
        with fop.CheckpointManager(directory, every_steps=1) as m:
            m.save(1, replicated_state(ctx, 1, rows=8))
            raise ValueError("every host stops here")
    except ValueError:
        pass
    with fop.CheckpointManager(directory, every_steps=1) as m:
        m.save(3, replicated_state(ctx, 3, rows=8))
        m.wait()
        return {"steps": m.steps()}


def _run(target, args, tmp_path):
    return run_processes(
        target,
        2,
        devices_per_process=2,
        args={"directory": str(tmp_path / "run"), **args},
        env=ENV,
        heartbeat_timeout_s=120,
        timeout_s=150,
    )


def test_an_error_leaving_one_processs_with_block_reaches_the_other_at_once(tmp_path):
    run = _run("test_lifecycle:error_in_block", {"via": "manager", "failing": [1]}, tmp_path)
    stories = "\n\n".join(p.describe() for p in run.procs)
    own, other = run[1].result, run[0].result
    assert own["error"] == "RuntimeError: the loss is NaN on host 1", stories
    assert own["t_error"] - own["t_raise"] < 15, stories  # its own error is not held up
    # Process 0 waits for process 1 in step 3's commit: it learns that process 1 left,
    # with which error, well before its 60 s stall timeout.
    error = other["error"]
    assert error.startswith(("CoordinationError", "ProcessFailedError")), stories
    assert "process 1 left" in error and "RuntimeError: the loss is NaN on host 1" in error
    assert other["t_error"] - own["t_raise"] < 15, stories
    # Step 2 (in flight when process 1 raised) was finished together; 3 never commits.
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == [1, 2]


def test_an_error_leaving_one_processs_callback_block_reaches_the_other_at_once(tmp_path):
    run = _run("test_lifecycle:error_in_block", {"via": "callback", "failing": [1]}, tmp_path)
    stories = "\n\n".join(p.describe() for p in run.procs)
    own, other = run[1].result, run[0].result
    assert own["error"] == "RuntimeError: the loss is NaN on host 1", stories
    assert "process 1 left" in other["error"], stories
    assert other["t_error"] - own["t_raise"] < 15, stories
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == [1, 2]


UNCAUGHT = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, me, directory, via = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if me != 0:  # once the service listens (see _multiprocess.await_coordinator)
    import socket
    for _ in range(6000):
        try:
            socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.01)
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=me,
                           shutdown_timeout_seconds=20)
import numpy as np
import flax_orbax_plugin as fop
if via == "manager":
    mngr = fop.CheckpointManager(directory, every_steps=1)  # no with block, never closed
    save = lambda step, tree: mngr.save(step, tree)
else:  # the core's saves, no manager: the last one still in flight
    save = lambda step, tree: fop.save_async(os.path.join(directory, str(step)), tree)
for step in range(1, 6):
    if me == 1 and step == 3:
        print(f"T_RAISE {time.time()}", flush=True)
        raise RuntimeError("the loss is NaN on host 1")  # nobody catches it
    try:
        save(step, {"w": np.full(4, step, np.float32)})
        if via == "core" and step >= 3:
            fop.save(os.path.join(directory, f"{step}-b"), {"w": np.ones(2)})
    except fop.CheckpointError as e:
        print(f"T_ERROR {time.time()}", flush=True)
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        os._exit(3)
"""


@pytest.mark.parametrize("via", ["manager", "core"])
def test_an_uncaught_error_without_a_with_block_reaches_the_other_at_once(tmp_path, via):
    """A plain ``mngr = CheckpointManager(...)`` (or the core's ``save_async``, no
    manager) and an exception nobody catches on one process: the others waited for it
    in their next save until the stall timeout (300 s by default), then jax's shutdown
    barrier aborted them all. The process now leaves the run when its program ends (its
    save in flight finished first), and the others learn which error ended it."""
    import sys

    outs = _proc.run_two_programs(
        [sys.executable, "-c", UNCAUGHT], [str(tmp_path / "run"), via], {**os.environ, **ENV}, 120
    )
    (out0, err0), (out1, err1) = outs
    stories = f"process 0:\n{out0}\n{err0[-3000:]}\nprocess 1:\n{out1}\n{err1[-3000:]}"
    assert "RuntimeError: the loss is NaN on host 1" in err1, stories
    t_raise = float(out1.split("T_RAISE ")[1].split()[0])
    t_error = float(out0.split("T_ERROR ")[1].split()[0])
    assert "process 1 left" in out0 and "RuntimeError: the loss is NaN on host 1" in out0
    assert t_error - t_raise < 15, stories  # not the 60 s stall timeout


def test_a_new_manager_after_an_error_every_process_shared_goes_on(tmp_path):
    run = _run("test_lifecycle:shared_error_then_a_new_manager", {}, tmp_path)
    run.check()
    assert [p.result["steps"] for p in run.procs] == [[1, 3], [1, 3]]
