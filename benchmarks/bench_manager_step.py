"""A manager step, before and after a change, side by side in one run.

    python benchmarks/bench_manager_step.py --other /path/to/other/checkout [--reps 5]

Saves the small-leaf tree (workload b: ~6,000 float32 arrays; ``--leaves`` to change)
as ``{"params": tree, "opt_state": tree}`` plus extras through ``CheckpointManager``
(synchronous, durable), in fresh processes, alternating this checkout and ``--other``
so machine noise hits both alike. Prints the median save time and blocking time of
each, and their ratio. Medians, never single runs.
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
import json, os, sys, time
import numpy as np
import flax_orbax_plugin as fop
n, directory = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
sizes = rng.integers(256, 16384, size=n)
tree = {
    f"layer_{i}": {"w": rng.standard_normal(int(s), dtype=np.float32)}
    for i, s in enumerate(sizes)
}
kw = {"async_save": False}
with fop.CheckpointManager(directory, **kw) as m:
    t0 = time.perf_counter()
    m.save(1, {"params": tree, "opt_state": tree}, extras={"loss": 0.5})
    total = time.perf_counter() - t0
    last = m.last_save
    blocking = getattr(last, "blocking_seconds", float("nan"))
print(json.dumps({"total": total, "blocking": blocking, "bytes": int(2 * sizes.sum() * 4)}))
"""


def once(path: str, leaves: int) -> dict:
    d = tempfile.mkdtemp(prefix="fop-step-", dir=os.environ.get("FOP_BENCH_TMP"))
    try:
        env = dict(os.environ, PYTHONPATH=path)
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(leaves), os.path.join(d, "run")],
            env=env,
            cwd=path,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", required=True, help="another checkout to compare with")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--leaves", type=int, default=3000, help="leaves per item (2 items)")
    args = p.parse_args()
    runs = {"this": [], "other": []}
    for _ in range(args.reps):
        for name, path in (("other", args.other), ("this", ROOT)):
            runs[name].append(once(path, args.leaves))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("total", "blocking")}
        for name, rs in runs.items()
    }
    mb = runs["this"][0]["bytes"] / 1e6
    print(f"manager step, {2 * args.leaves} leaves ({mb:.0f} MB), median of {args.reps}:")
    print("| checkout | save (durable) | blocking |")
    print("|---|---|---|")
    for name in ("other", "this"):
        print(f"| {name} | {med[name]['total']:.3f} s | {med[name]['blocking']:.3f} s |")
    print(f"ratio this/other (save): {med['this']['total'] / med['other']['total']:.2f}")


if __name__ == "__main__":
    main()
