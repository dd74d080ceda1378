"""Cancel latency: from ``SaveHandle.cancel()`` to the handle done and its staging gone.

    python benchmarks/bench_cancel.py [--leaves 64] [--leaf-mib 4] [--rounds 7]
                                      [--markdown PATH]

A ``fop.save_async`` of ``--leaves`` float32 leaves of ``--leaf-mib`` MiB each into a
fresh local directory. First a save that runs to its commit (its background time, the
scale the latency is judged against); then saves cancelled at three moments of their
background phase: at once (as ``save_async`` returns), at a quarter and at half of the
full save's background time. Per cancel: the time ``cancel()`` took (it returns once
the background phase ended: stopped, staging removed) and whether anything is left
beside the target (it must be nothing) or committed (it must not be, except a save that
committed before the cancel reached it, counted apart). Then the manager's
``supersede=True``: the blocking time of a save that supersedes a save still writing,
against the same save waiting for it (default). Medians over ``--rounds``; the
one-minute load and the CPU steal share (``/proc/stat``) beside each row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
from machine_load import cpu_times, load1  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402


def tree(leaves: int, mib: int, seed: int) -> dict:
    n = mib * (1 << 20) // 4
    return {f"l{i:03d}": np.full((n,), seed + i, np.float32) for i in range(leaves)}


def _full(base: str, state: dict) -> float:
    fop_rm(base, "full")
    handle = fop.save_async(os.path.join(base, "full"), state)
    t = time.perf_counter()
    handle.wait()
    return time.perf_counter() - t


def _cancelled(base: str, state: dict, delay: float, k: int) -> tuple[float, bool, bool]:
    target = os.path.join(base, f"c{k}")
    handle = fop.save_async(target, state)
    if delay:
        time.sleep(delay)
    t = time.perf_counter()
    stopped = handle.cancel()
    latency = time.perf_counter() - t
    left = [n for n in os.listdir(base) if n.startswith(f"c{k}.")]
    return latency, stopped, bool(left) or (stopped and os.path.exists(target))


def _supersede(base: str, state: dict, supersede: bool, k: int) -> float:
    with fop.CheckpointManager(os.path.join(base, f"m{k}"), supersede=supersede) as mngr:
        mngr.save(1, state)
        t = time.perf_counter()
        mngr.save(2, state)  # step 1 is still writing
        blocking = time.perf_counter() - t
        mngr.wait()
    return blocking


class Row:
    def __init__(self) -> None:
        self.values: list[float] = []
        self.load: list[float] = []
        self.steal: list[float] = []
        self.notes: list[str] = []

    def measure(self, fn, *args):
        s0, t0 = cpu_times()
        out = fn(*args)
        s1, t1 = cpu_times()
        self.load.append(load1())
        self.steal.append(100 * (s1 - s0) / max(1, t1 - t0))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=64)
    parser.add_argument("--leaf-mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    state = tree(args.leaves, args.leaf_mib, 0)
    rows = {
        name: Row()
        for name in (
            "full save (background)",
            "cancel at once",
            "cancel at 1/4",
            "cancel at 1/2",
            "next save waits (default)",
            "next save supersedes",
        )
    }
    leftovers = committed_first = 0
    with tempfile.TemporaryDirectory(prefix="fop-cancel-") as base:
        _full(base, tree(4, 1, 1))  # warm up
        for r in range(args.rounds):
            full = rows["full save (background)"]
            background = full.measure(_full, base, state)
            full.values.append(background)
            fop_rm(base, "full")
            for i, (name, frac) in enumerate(
                (("cancel at once", 0.0), ("cancel at 1/4", 0.25), ("cancel at 1/2", 0.5))
            ):
                row = rows[name]
                k = r * 10 + i
                latency, stopped, left = row.measure(_cancelled, base, state, frac * background, k)
                row.values.append(latency)
                leftovers += left
                committed_first += not stopped
                fop_rm(base, f"c{k}")
            for name, sup in (("next save waits (default)", False), ("next save supersedes", True)):
                row = rows[name]
                row.values.append(row.measure(_supersede, base, state, sup, r * 10 + sup))
    mib = args.leaves * args.leaf_mib
    lines = [
        f"{args.leaves} leaves x {args.leaf_mib} MiB = {mib} MiB, local disk; "
        f"{args.rounds} rounds; staging left after a cancel: {leftovers}; "
        f"committed before the cancel reached it: {committed_first}",
        "",
        "| case | median (ms) | min-max (ms) | load 1 min | steal % |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        v = [x * 1000 for x in row.values]
        lines.append(
            f"| {name} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} "
            f"| {statistics.median(row.load):.2f} | {statistics.median(row.steal):.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(text + "\n")


def fop_rm(base: str, name: str) -> None:
    """Removes a benchmark's own target (created in this temporary directory)."""
    import shutil

    shutil.rmtree(os.path.join(base, name), ignore_errors=True)


if __name__ == "__main__":
    main()
