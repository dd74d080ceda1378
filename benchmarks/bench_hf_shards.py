"""What an HF-shards item (fop.HFShards) adds to a manager's save of the 1.2 GB state.

    python benchmarks/bench_hf_shards.py [--runs 5] [--layout single|2x4] [--tiny]

Workload (a) of ``common.py`` (params + Adam mu/nu, ~1.2 GB; the params, ~0.4 GB,
are what the shards hold), saved by a manager with ``async_save=False`` (the figure
is the whole save: blocking phase, writes, the step's sync and commit), alternately
without and with ``hf_shards=fop.HFShards(every_steps=1)`` into fresh directories of
the same disk, so both see the same machine. ``--layout 2x4``: the state sharded
over 8 CPU devices (each device's regions written at their offsets). Medians; load
and /proc/stat steal beside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common
from machine_load import cpu_times, load1

import flax_orbax_plugin as fop


def _save(directory: str, state: dict, hf: fop.HFShards | None) -> float:
    started = time.perf_counter()
    with fop.CheckpointManager(directory, async_save=False, hf_shards=hf) as mngr:
        mngr.save(1, state)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layout", default="single", choices=("single", "2x4"))
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        os.environ[common.SIZE_ENV] = "tiny"
    specs = common.tree_specs("a")
    state = common.build_jax_tree(specs, args.layout)
    size = common.total_bytes(specs) / 1e9
    params = common.total_bytes(common.params_specs(specs)) / 1e9
    hf = fop.HFShards(every_steps=1, max_shard_bytes="200MB")
    os.makedirs(common.TMP, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=common.TMP) as tmp:
        _save(os.path.join(tmp, "warm"), state, hf)  # first use (imports, buffers) out
        common.rmtree(os.path.join(tmp, "warm"))
        rows = {"without": [], "with": []}
        loads, steal0, total0 = [], *cpu_times()
        for i in range(args.runs):  # interleaved
            for name, option in (("without", None), ("with", hf)):
                where = os.path.join(tmp, f"{name}-{i}")
                rows[name].append(_save(where, state, option))
                loads.append(load1())
                common.rmtree(where)
        steal1, total1 = cpu_times()
    steal = 100.0 * (steal1 - steal0) / max(1, total1 - total0)
    without, with_hf = (statistics.median(rows[k]) for k in ("without", "with"))
    print(f"state {size:.2f} GB (params {params:.2f} GB), layout {args.layout}, runs {args.runs}")
    print(f"save without hf_shards: median {without:.3f} s  {rows['without']}")
    print(f"save with hf_shards:    median {with_hf:.3f} s  {rows['with']}")
    print(f"extra: {with_hf - without:+.3f} s ({with_hf / without:.2f}x the save without)")
    print(f"load1 median {statistics.median(loads):.2f}, steal {steal:.1f}%")


if __name__ == "__main__":
    main()
