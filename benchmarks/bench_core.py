"""Issue 2's benchmark: the plugin's core against the raw limit of this disk.

    benchmarks/run.sh core            # or: python benchmarks/bench_core.py [--quick]

Workloads (a) ~1.2 GB training state and (b) ~6,000 small arrays, each measured
side by side with the raw limit (the same bytes in one file, written by parallel
pwrite calls and one fsync, read back cold by parallel preadv calls; the single
sequential stream is a second row). Every figure is the median of ``--repeats`` runs,
each operation in a fresh process. Writes benchmarks/results/core.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C
import harness as H


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workloads", default="ab")
    p.add_argument("--quick", action="store_true", help="one repeat, no verification")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--tag", default="", help="write results/core-TAG.* instead of core.*")
    C.add_raw_and_tiny_options(p)
    a = p.parse_args(argv)
    if a.quick:
        a.repeats = 1
    if a.tiny:
        os.environ[C.SIZE_ENV] = "tiny"  # inherited by every worker
    if not C.is_root():
        print(C.COLD_NOTE)
    t0 = time.perf_counter()
    rows = H.run_matrix(
        ["raw", "raw1", "fop"],
        list(a.workloads),
        a.repeats,
        verify=not (a.no_verify or a.quick),
        numpy_restore=True,
        streams=a.raw_streams,
    )
    tag = a.tag or ("tiny" if a.tiny else "")  # a check run never replaces the results
    stem = "core" + (f"-{tag}" if tag else "")
    _, _, failed = H.write_outputs(
        stem,
        "flax_orbax_plugin core vs the raw limit (issue 2)",
        rows,
        [],
        lambda s, _t: H.core_targets(s),
        config=vars(a) | {"wall_s": time.perf_counter() - t0},
    )
    H.log(f"done in {time.perf_counter() - t0:.0f}s")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
