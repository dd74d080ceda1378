"""Cost of the per-step preemption check: µs per ``on_step_end`` that saves nothing.

    python benchmarks/bench_preemption_check.py [--processes 2] [--steps 20000]

In ``--processes`` real ``jax.distributed`` processes (``tests/support/_multiprocess.py``; 1:
no jax.distributed, the SIGTERM-handler way), a ``CheckpointCallback`` with a policy
that never saves receives ``--steps`` ``on_step_end`` calls, with
``handle_sigterm=True`` (several processes: jax's ``reached_preemption_sync_point``
asked once per step) and without; also jax's call alone. Medians of 5 rounds, in µs
per call, printed as one JSON line per process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "tests", "support"), ROOT]


def measure(ctx, directory, steps=20000, rounds=5):
    import numpy as np

    import flax_orbax_plugin as fop

    state = {"params": {"w": np.zeros(4, np.float32)}}
    out = {}
    for label, options in (("without", {}), ("handle_sigterm", {"handle_sigterm": True})):
        cb = fop.CheckpointCallback(
            os.path.join(directory, label),
            every_steps=10**12,
            manager_options=options,
        )
        cb.on_train_start(state)
        base = 0
        per_round = []
        for _ in range(rounds):
            t = time.perf_counter()
            for step in range(base + 1, base + steps + 1):
                cb.on_step_end(step, state)
            per_round.append((time.perf_counter() - t) / steps * 1e6)
            base += steps
        out[label] = round(statistics.median(per_round), 3)
        out[f"{label}_mode"] = getattr(cb.manager._schedule.preemption, "mode", None)
        cb.close()
    if ctx is not None:
        from jax.experimental import multihost_utils

        t = time.perf_counter()
        for step in range(steps):
            multihost_utils.reached_preemption_sync_point(10**9 + step)
        out["jax_call_alone"] = round((time.perf_counter() - t) / steps * 1e6, 3)
    out["check_cost"] = round(out["handle_sigterm"] - out["without"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20000)
    args = ap.parse_args()
    directory = tempfile.mkdtemp(prefix="fop-bench-preempt-")
    if args.processes == 1:
        print(json.dumps({"process": 0, **measure(None, directory, args.steps)}))
        return
    from _multiprocess import run_processes

    run = run_processes(
        "bench_preemption_check:measure",
        args.processes,
        devices_per_process=1,
        args={"directory": directory, "steps": args.steps},
        env={"PYTHONPATH": HERE},
        timeout_s=600,
    ).check()
    for p in run.procs:
        print(json.dumps({"process": p.process_id, **p.result}))


if __name__ == "__main__":
    main()
