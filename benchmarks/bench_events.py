"""What the checkpoint events cost a save: this checkout against another, side by side.

    python benchmarks/bench_events.py --other /path/to/checkout/without/events [--reps 5]

Each run is a fresh process that saves ``--steps`` steps of the small-leaf tree
(``--leaves`` float32 arrays per item, two items, plus extras) through
``CheckpointManager`` (synchronous, durable); this checkout also counts each committed
step's files (``events.stored_size``) and delivers the events to a hook. Runs
alternate between the two checkouts so machine noise hits both alike. Prints the
median save time of each, their ratio, the median time of one count of a committed
step, and beside each figure the 1-minute load average and the share of CPU time
stolen by the hypervisor (``/proc/stat``) while it was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, sys, time
import numpy as np
import flax_orbax_plugin as fop
n, steps, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
tree = {f"layer_{i}": {"w": rng.standard_normal(int(s), dtype=np.float32)}
        for i, s in enumerate(rng.integers(256, 16384, size=n))}
events = []
kw = {"async_save": False}
try:
    kw["on_event"] = events.append
    fop.CheckpointManager(directory + "-probe", **kw).close()
except TypeError:
    kw.pop("on_event")  # a checkout without events
times, counts = [], []
with fop.CheckpointManager(directory, **kw) as m:
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        m.save(step, {"params": tree, "opt_state": tree}, extras={"loss": 0.5})
        times.append(time.perf_counter() - t0)
    if "on_event" in kw:
        from flax_orbax_plugin._manager.events import stored_size
        loc = fop.Location.from_path(f"{directory}/{steps}")
        for _ in range(20):
            t0 = time.perf_counter()
            files, size = stored_size(loc)
            counts.append(time.perf_counter() - t0)
print(json.dumps({"save": sorted(times)[len(times) // 2], "count": counts,
                  "events": len(events)}))
"""


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[7], sum(fields)


def once(path: str, leaves: int, steps: int) -> dict:
    d = tempfile.mkdtemp(prefix="fop-events-", dir=os.environ.get("FOP_BENCH_TMP"))
    steal0, total0 = cpu_times()
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(leaves), str(steps), os.path.join(d, "run")],
            env=dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu"),
            cwd=path,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(d, ignore_errors=True)
    steal1, total1 = cpu_times()
    result["load"] = os.getloadavg()[0]
    result["steal"] = (steal1 - steal0) / max(1, total1 - total0)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", required=True, help="a checkout to compare with")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--leaves", type=int, default=1000, help="leaves per item (2 items)")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"other": [], "this": []}
    for _ in range(args.reps):
        for name, path in (("other", args.other), ("this", ROOT)):
            runs[name].append(once(path, args.leaves, args.steps))
    med = statistics.median
    print(f"manager save, {2 * args.leaves} leaves, median of {args.reps} runs x {args.steps}:")
    print("| checkout | save (durable) | events per run | load (1 min) | steal |")
    print("|---|---|---|---|---|")
    for name, rs in runs.items():
        print(
            f"| {name} | {med(r['save'] for r in rs) * 1e3:.1f} ms "
            f"| {med(r['events'] for r in rs):.0f} | {med(r['load'] for r in rs):.2f} "
            f"| {med(r['steal'] for r in rs):.1%} |"
        )
    for name, rs in runs.items():
        print(f"{name} runs (ms):", " ".join(f"{r['save'] * 1e3:.0f}" for r in rs))
    ratio = med(r["save"] for r in runs["this"]) / med(r["save"] for r in runs["other"])
    counts = [c for r in runs["this"] for c in r["count"]]
    print(f"ratio this/other (save): {ratio:.3f}")
    print(f"one count of a committed step (stored_size): {med(counts) * 1e6:.0f} us median")


if __name__ == "__main__":
    main()
