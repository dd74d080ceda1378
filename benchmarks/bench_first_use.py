"""The first save of a process: what it costs, and what importing flax.nnx (which the
first save of a plain dict did before, to recognise NNX objects) would add to it.

    python benchmarks/bench_first_use.py [--runs 5]

Each figure is a fresh process; medians; load and steal beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from machine_load import cpu_times, load1

FIRST_SAVE = """
import json, sys, time
import numpy as np
import flax_orbax_plugin as fop
fop.CheckpointManager  # the API loaded before the clock
t = time.perf_counter()
with fop.CheckpointManager(sys.argv[1]) as m:
    m.save(1, {"params": {"w": np.ones(1024, np.float32)}})
    m.wait()
print(json.dumps({"s": time.perf_counter() - t,
                  "flax": any(n.split(".")[0] == "flax" for n in sys.modules)}))
"""
IMPORT_NNX = """
import json, time
import jax, numpy, tensorstore  # what the package had loaded already
t = time.perf_counter()
from flax import nnx
print(json.dumps({"s": time.perf_counter() - t}))
"""


def _child(code: str, *args: str) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    n = ap.parse_args().runs
    steal0, total0 = cpu_times()
    saves, nnx, loaded = [], [], []
    for _ in range(n):  # interleaved: the two figures see the same machine
        with tempfile.TemporaryDirectory() as d:
            r = _child(FIRST_SAVE, os.path.join(d, "run"))
        saves.append(r["s"])
        loaded.append(r["flax"])
        nnx.append(_child(IMPORT_NNX)["s"])
    steal1, total1 = cpu_times()
    steal = 100.0 * (steal1 - steal0) / max(1, total1 - total0)
    print(
        f"first manager save of a plain dict: median {statistics.median(saves):.3f} s "
        f"(flax imported: {any(loaded)})"
    )
    print(f"importing flax.nnx, which that save did before: median {statistics.median(nnx):.3f} s")
    print(f"runs {n}, load1 {load1():.2f}, steal {steal:.1f}%")


if __name__ == "__main__":
    main()
