"""Continuous(max_overhead_percent=p): the time a loop spends in ``save`` against its cap.

    python benchmarks/bench_continuous.py [--mb 64] [--steps 120] [--step-ms 20] [--rounds 3]

One process, a local directory under benchmarks/results/tmp. A training loop whose step
is ``--step-ms`` of numpy work on a ``--mb`` MB float32 state calls ``mngr.save(step,
state)`` every step under each policy, side by side in one run: ``EverySteps(1)`` (the
baseline: a save whenever asked, waiting for the previous one), and ``Continuous`` with
caps of 5, 10 and 25 percent. Measured from outside the manager: the seconds spent
inside ``save`` (the loop's overhead: blocking phase plus any wait for the save in
flight) as a percent of the loop's wall time, the number of steps saved, and the
median step time outside ``save``. Medians over ``--rounds`` rounds; load average and
CPU steal of the run beside the figures. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import numpy as np  # noqa: E402
from machine_load import cpu_times, load1  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402


def train_step(work: np.ndarray, ms: float) -> None:
    """About ``ms`` milliseconds of numpy work (the measured part of a step)."""
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        work @ work


def one_loop(directory: str, policy, state: dict, steps: int, step_ms: float) -> dict:
    work = np.ones((128, 128), np.float32)
    in_save, outside = 0.0, []
    started = time.perf_counter()
    saved = 0
    with fop.CheckpointManager(directory, policy=policy, retention=fop.KeepLast(1)) as mngr:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            train_step(work, step_ms)
            t1 = time.perf_counter()
            saved += bool(mngr.save(step, state))
            t2 = time.perf_counter()
            outside.append(t1 - t0)
            in_save += t2 - t1
        wall = time.perf_counter() - started
        mngr.wait()
    return {
        "overhead_percent": 100.0 * in_save / wall,
        "saved": saved,
        "step_ms": 1000.0 * statistics.median(outside),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    n = args.mb * 2**20 // 4 // 4
    state = {"params": {f"w{i}": np.random.default_rng(i).random(n, np.float32) for i in range(4)}}
    policies = {
        "every_step": fop.EverySteps(1),
        "continuous_5": fop.Continuous(max_overhead_percent=5),
        "continuous_10": fop.Continuous(max_overhead_percent=10),
        "continuous_25": fop.Continuous(max_overhead_percent=25),
    }
    tmp = os.path.join(HERE, "results", "tmp")
    os.makedirs(tmp, exist_ok=True)
    steal0, total0 = cpu_times()
    runs: dict[str, list[dict]] = {name: [] for name in policies}
    for _ in range(args.rounds):
        for name, policy in policies.items():  # side by side, interleaved per round
            directory = tempfile.mkdtemp(prefix="continuous-", dir=tmp)
            try:
                runs[name].append(one_loop(directory, policy, state, args.steps, args.step_ms))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    steal1, total1 = cpu_times()
    out = {
        "mb": args.mb,
        "steps": args.steps,
        "step_ms_asked": args.step_ms,
        "rounds": args.rounds,
        "load1": load1(),
        "steal_percent": round(100.0 * (steal1 - steal0) / max(total1 - total0, 1), 2),
    }
    for name, rounds in runs.items():
        out[name] = {k: round(statistics.median(r[k] for r in rounds), 2) for k in rounds[0]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
