"""What the CLI's progress bar costs `verify`: the same checkpoint verified with no
bar and with rich's bar drawing to a real pseudo-terminal, alternately.

    python benchmarks/bench_cli_progress.py [--mib 128] [--runs 5]

Prints the median seconds of each and their ratio, with the load average and the
steal and idle shares of CPU time (/proc/stat) over the runs. The data is read from
the page cache after the first run (the bar's cost is what is measured, not the disk).
"""

from __future__ import annotations

import argparse
import os
import pty
import shutil
import statistics
import tempfile
import threading
import time

import numpy as np

import flax_orbax_plugin as fop
from flax_orbax_plugin.cli.display import byte_progress


def _cpu() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=128, help="checkpoint size (8 leaves)")
    ap.add_argument("--runs", type=int, default=5, help="runs of each (the median is shown)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fop-bench-progress-")
    try:
        path = os.path.join(work, "ckpt")
        rows = args.mib * (1 << 20) // (8 * 1024 * 4)
        rng = np.random.default_rng(0)
        fop.save(path, {f"w{i}": rng.random((rows, 1024), np.float32) for i in range(8)})
        master, slave = pty.openpty()
        terminal = os.fdopen(slave, "w")

        def drain() -> None:  # the terminal's reader: what is drawn is read and dropped
            while True:
                try:
                    os.read(master, 65536)
                except OSError:
                    return

        threading.Thread(target=drain, daemon=True).start()
        fop.verify(path)  # fills the page cache
        times: dict[str, list[float]] = {"no bar": [], "bar on a terminal": []}
        before, load = _cpu(), os.getloadavg()[0]
        for _ in range(args.runs):
            for name in times:
                bar = byte_progress("verify", stream=terminal) if name != "no bar" else None
                start = time.perf_counter()
                results = fop.verify(path, progress=bar)
                times[name].append(time.perf_counter() - start)
                assert all(r.ok for r in results)
        delta = [b - a for a, b in zip(before, _cpu(), strict=True)]
        medians = {k: statistics.median(v) for k, v in times.items()}
        for name, value in medians.items():
            print(f"{name:>20}: {value:.3f} s (median of {args.runs}, {args.mib} MiB)")
        print(f"{'ratio':>20}: {medians['bar on a terminal'] / medians['no bar']:.3f}")
        print(
            f"load {load:.1f} -> {os.getloadavg()[0]:.1f}, steal "
            f"{100 * delta[7] / sum(delta):.1f}%, idle {100 * delta[3] / sum(delta):.1f}%"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
