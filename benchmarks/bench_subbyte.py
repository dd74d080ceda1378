"""Issue 36, item 1: what sub-byte leaves store and cost, packed (FORMAT.md, packed
sub-byte arrays) against the same count of one-byte values.

    python benchmarks/bench_subbyte.py [--mb 64] [--repeats 3] [--format-versions 1,2]

For each dtype (int4, uint4, float4_e2m1fn, int2, uint2, int1, float6_e2m3fn, and
int8 as the one-value-per-byte reference) saves one leaf of ``--mb`` million values
with ``fop.save`` (durable, committed) and restores it warm with ``fop.restore``;
dtypes alternate within each repeat so machine noise hits them alike. Reports the
bytes on disk, their ratio to int8's, the median save and restore seconds and their
ratio to int8's, and checks every restore bit for bit. Beside each row: the 1-minute
load average at its end and the CPU share stolen by the hypervisor meanwhile
(``/proc/stat``). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from machine_load import cpu_times, load1  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402
from flax_orbax_plugin._format import layout as _layout  # noqa: E402

DTYPES = ["int8", "int4", "uint4", "float4_e2m1fn", "int2", "uint2", "int1", "float6_e2m3fn"]


def _values(name: str, count: int) -> np.ndarray:
    bits = min(8, _layout.DTYPES[name].bits)
    raw = np.random.default_rng(0).integers(0, 1 << bits, count, dtype=np.uint8)
    return raw.view(_layout.dtype_from_name(name)).reshape(-1, 4096)


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--mb", type=float, default=64, help="million values per leaf")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--format-versions", default="1,2")
    args = p.parse_args()
    count = int(args.mb * 1e6) // 4096 * 4096
    work = tempfile.mkdtemp(prefix="fop-subbyte-")
    rows = []
    try:
        for version in [int(v) for v in args.format_versions.split(",")]:
            trees = {name: {"w": _values(name, count)} for name in DTYPES}
            times = {name: ([], []) for name in DTYPES}
            disk, load, steal = {}, {}, {}
            for _ in range(args.repeats):
                for name in DTYPES:
                    path = os.path.join(work, f"{name}-v{version}")
                    shutil.rmtree(path, ignore_errors=True)
                    s0, t0 = cpu_times()
                    start = time.perf_counter()
                    fop.save(path, trees[name], format_version=version)
                    mid = time.perf_counter()
                    got = fop.restore(path)["w"]
                    end = time.perf_counter()
                    s1, t1 = cpu_times()
                    assert got.tobytes() == trees[name]["w"].tobytes(), name
                    times[name][0].append(mid - start)
                    times[name][1].append(end - mid)
                    disk[name] = _disk_bytes(path)
                    load[name] = load1()
                    steal[name] = (s1 - s0) / max(1, t1 - t0)
            base = {k: statistics.median(v) for k, v in zip("sr", times["int8"], strict=True)}
            for name in DTYPES:
                save, restore = (statistics.median(v) for v in times[name])
                rows.append(
                    f"| {version} | {name} | {disk[name]:,} | {disk[name] / disk['int8']:.3f} "
                    f"| {save:.3f} | {save / base['s']:.2f} | {restore:.3f} "
                    f"| {restore / base['r']:.2f} | {load[name]:.2f} | {steal[name]:.1%} |"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{count:,} values per leaf, median of {args.repeats}\n")
    print(
        "| format | dtype | bytes on disk | / int8 | save s | / int8 | restore s | / int8 "
        "| load1 | steal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
