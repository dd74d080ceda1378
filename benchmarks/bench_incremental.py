"""Incremental steps: step 2 of a fine-tuning state with 90% frozen, with and without
reuse, side by side.

    python benchmarks/bench_incremental.py [--mib 256] [--reps 3] [--dir DIR]

The state (``--mib`` MiB of float32 jax.Arrays on the default device): ``params`` = a
frozen base (90%: 8 equal leaves) plus an adapter (10%) that changes every step. Each
repetition, for each mode, in a fresh directory: ``CheckpointManager(incremental=mode,
async_save=False)`` saves step 1 (full), then step 2 (the adapter changed); step 2's
save time (blocking + background, durable and committed) and bytes written / reused are
recorded. Prints medians of the repetitions; modes alternate so machine noise hits both
alike. A third line, the floor: a full save of a state holding only the adapter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import flax_orbax_plugin as fop  # noqa: E402

MiB = 1 << 20


def make_state(total_mib: int, step: int) -> dict:
    rng = np.random.default_rng(0)
    base_leaf = int(total_mib * 0.9 / 8 * MiB) // 4 // 1024 * 1024
    adapter = int(total_mib * 0.1 * MiB) // 4 // 1024 * 1024
    base = {
        f"layer_{i}": rng.standard_normal((base_leaf // 1024, 1024), dtype=np.float32)
        for i in range(8)
    }
    state = {
        "params": {
            "base": base,
            "adapter": np.full((adapter // 1024, 1024), float(step), np.float32),
        }
    }
    return jax.device_put(state)


def one(directory: str, incremental: bool | None, states) -> tuple[float, int, int]:
    shutil.rmtree(directory, ignore_errors=True)
    if incremental is None:  # the floor: the adapter alone, saved in full
        states = [{"params": {"adapter": s["params"]["adapter"]}} for s in states]
    with fop.CheckpointManager(directory, incremental=bool(incremental), async_save=False) as m:
        m.save(1, states[0])
        t0 = time.perf_counter()
        m.save(2, states[1])
        seconds = time.perf_counter() - t0
        r = m.last_save
    shutil.rmtree(directory, ignore_errors=True)
    return seconds, r.bytes_written, r.bytes_reused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="fop-bench-incremental-")
    states = [make_state(args.mib, 1), make_state(args.mib, 2)]
    total = sum(a.nbytes for s in (states[0],) for a in _leaves(s))
    modes = (False, True, None)
    runs: dict = {mode: [] for mode in modes}
    for _ in range(args.reps):
        for mode in modes:
            runs[mode].append(one(os.path.join(root, f"inc-{mode}"), mode, states))
    print(f"state {total / MiB:.0f} MiB (90% frozen), step 2, medians of {args.reps}:")
    print(f"{'mode':<14} {'save s':>8} {'MiB written':>12} {'MiB reused':>11}")
    for mode, label in ((False, "full"), (True, "incremental"), (None, "adapter only")):
        secs = statistics.median(r[0] for r in runs[mode])
        wrote = statistics.median(r[1] for r in runs[mode]) / MiB
        reused = statistics.median(r[2] for r in runs[mode]) / MiB
        print(f"{label:<14} {secs:>8.3f} {wrote:>12.1f} {reused:>11.1f}")
    full = statistics.median(r[0] for r in runs[False])
    inc = statistics.median(r[0] for r in runs[True])
    print(f"speed-up {full / inc:.1f}x; all runs (s): full {[round(r[0], 3) for r in runs[False]]}")
    print(f"  incremental {[round(r[0], 3) for r in runs[True]]}")
    print(f"  adapter only {[round(r[0], 3) for r in runs[None]]}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


if __name__ == "__main__":
    main()
