"""A/B of two checkouts on the small end: ``fop.save`` and ``fop.restore`` of a small
tree and of a tree of many small leaves, and an async manager step, per call.

    python benchmarks/bench_small_ab.py A_DIR B_DIR [--rounds 7]

Each round runs one child process per checkout (the order alternating between
rounds, so the shared machine's drift hits both alike); a child warms up, then times
``--calls`` calls of each operation and prints their median. Reported: the median
over rounds per checkout, B/A, and the load average and CPU steal (from /proc/stat)
over the run. For structural changes (no figure should move); not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, statistics, sys, tempfile, time
import numpy as np
import flax_orbax_plugin as fop
calls = int(sys.argv[1])
rng = np.random.default_rng(0)
small = {"dense": {"kernel": rng.standard_normal((64, 32), dtype=np.float32),
                   "bias": np.zeros(32, np.float32)}, "out": rng.standard_normal((32, 8))}
many = {f"layer{i}": {"w": np.full((16,), i, np.float32), "b": np.int32(i)} for i in range(500)}
out = {}
with tempfile.TemporaryDirectory() as tmp:
    def timed(name, fn):
        fn()
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
    for label, tree in (("small", small), ("many", many)):
        path = f"{tmp}/{label}"
        timed(f"save_{label}", lambda: fop.save(path, tree, force=True))
        timed(f"restore_{label}", lambda: fop.restore(path))
    steps = iter(range(1, 10**6))
    with fop.CheckpointManager(f"{tmp}/run", keep=2) as m:
        def step():
            m.save(next(steps), {"params": small}); m.wait()
        timed("manager_step", step)
print("RESULT " + json.dumps(out))
"""


def _cpu() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[7]  # total jiffies, steal


def _child(checkout: str, calls: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(calls)],
        env={"PYTHONPATH": checkout, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tempfile.gettempdir(),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{checkout}: child failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=9)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    loads = []
    total0, steal0 = _cpu()
    for r in range(args.rounds):
        order = [("A", args.a), ("B", args.b)]
        for label, checkout in order if r % 2 == 0 else order[::-1]:
            runs[label].append(_child(checkout, args.calls))
            with open("/proc/loadavg") as f:
                loads.append(float(f.read().split()[0]))
    total1, steal1 = _cpu()
    steal = 100.0 * (steal1 - steal0) / max(1, total1 - total0)
    print(f"A = {args.a}\nB = {args.b}")
    print(f"rounds {args.rounds}, calls per child {args.calls}; load average median ", end="")
    print(f"{statistics.median(loads):.1f} (min {min(loads):.1f}, max {max(loads):.1f}); ", end="")
    print(f"CPU steal {steal:.1f}%")
    print("| operation | A median ms | B median ms | B/A |")
    print("|---|---|---|---|")
    for name in runs["A"][0]:
        a = statistics.median(run[name] for run in runs["A"]) * 1e3
        b = statistics.median(run[name] for run in runs["B"]) * 1e3
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
