"""Issue 2's benchmark: the plugin's core against the raw limit of this disk.

    benchmarks/run.sh core            # or: python benchmarks/bench_core.py [--quick]

Workloads (a) ~1.2 GB training state and (b) ~6,000 small arrays, each measured
side by side with the raw limit (the same bytes, one file, one fsync; read back
after dropping the page cache). Every figure is the median of ``--repeats`` runs,
each operation in a fresh process. Writes benchmarks/results/core.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as H  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", default="ab")
    p.add_argument("--quick", action="store_true", help="one repeat, no verification")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--tag", default="", help="write results/core-TAG.* instead of core.*")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats = 1
    if os.geteuid() != 0:
        sys.exit("cold reads need root to drop the page cache")
    t0 = time.perf_counter()
    rows = H.run_matrix(
        ["raw", "fop"],
        list(a.workloads),
        a.repeats,
        verify=not (a.no_verify or a.quick),
        numpy_restore=True,
    )
    stem = "core" + (f"-{a.tag}" if a.tag else "")
    H.write_outputs(
        stem,
        "flax_orbax_plugin core vs the raw limit (issue 2)",
        rows,
        [],
        lambda s, _t: H.core_targets(s),
        config=vars(a) | {"wall_s": time.perf_counter() - t0},
    )
    H.log(f"done in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
