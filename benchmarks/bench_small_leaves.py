"""Issue 38: restoring many small leaves, against one msgpack blob and a raw read.

    python benchmarks/bench_small_leaves.py [--counts 6000,60000] [--repeats 1]
    python benchmarks/bench_small_leaves.py --package /work/main   # the same, another tree

Trees: workload (b) of the peer benchmark (params and two Adam moments, 2,000 float32
leaves each, ~193 MB), and the same bytes cut into 10x as many 1-D leaves (60,000).
Each is saved once per format version (1 and 2, fop.save) and once as one Flax msgpack
file, and its bytes once as one raw file. Every measurement is a fresh process: it
warms up on a tiny tree, evicts the measured files from the page cache
(posix_fadvise DONTNEED, as tests/manager/test_manager.py evicts a step), then times
one restore onto jax.ShapeDtypeStruct targets on one device (params-only: the params
subtree alone, partial=True); the raw row reads the file into one buffer. The load
average and /proc/stat steal are recorded beside every figure. Orbax and DCP rows
are left out (see the README's peer table for them on the 6,000-leaf tree).
Writes benchmarks/results/small_leaves.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402
import machine_load as L  # noqa: E402

ROWS = ["fop v1", "fop v1 params", "fop v2", "fop v2 params", "msgpack", "msgpack params", "raw"]


def specs_for(count: int) -> list:
    """The 6,000-leaf tree, or its bytes in ``count // 6000`` times as many leaves."""
    base = [s for s in C.tree_specs("b") if s.path[-1] != "count"]
    split = max(1, count // len(base))
    if split == 1:
        return base
    out = []
    for s in base:
        n = -(-int(s.nbytes // 4) // split)
        for k in range(split):
            path = s.path[:-1] + (f"{s.path[-1]}_{k}",)
            out.append(C.LeafSpec(path, (n,), s.dtype, s.seed + (k,)))
    return out


def _like(specs, params_only: bool):
    like = C.build_like(specs, "single")
    return {"params": like["params"]} if params_only else like


def worker(a) -> dict:
    """One measurement in this (fresh) process."""
    import jax
    import numpy as np

    specs = specs_for(a.count)
    if a.row == "raw":
        C.evict(a.path)
        t0 = time.perf_counter()
        buf = C.raw_read(a.path)
        return {"s": time.perf_counter() - t0, "bytes": int(buf.nbytes)}
    params_only = a.row.endswith("params")
    like = _like(specs, params_only)
    if a.row.startswith("fop"):
        import flax_orbax_plugin as fop

        warm = os.path.join(os.path.dirname(a.path), "warm")
        tiny = {"params": {"a": np.ones(8, np.float32)}, "o": {"b": np.ones(8, np.float32)}}
        fop.save(warm, tiny, format_version=int(a.row[5]), force=True)
        tl = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tiny)
        jax.block_until_ready(fop.restore(warm, tl))
        jax.block_until_ready(fop.restore(warm, {"params": tl["params"]}, partial=True))
        restore = lambda: fop.restore(a.path, like, partial=params_only)
    else:
        from peers.flax_msgpack import Adapter

        ad = Adapter()
        restore = (
            (lambda: ad.restore_params(a.path, like["params"]))
            if params_only
            else (lambda: ad.restore(a.path, like))
        )
    C.evict(a.path)
    t0 = time.perf_counter()
    out = jax.block_until_ready(restore())
    seconds = time.perf_counter() - t0
    if params_only and not a.row.startswith("fop"):
        out = {"params": out}  # msgpack's adapter returns the params subtree
    first = specs[0]
    value = np.asarray(C.get_path(out, first.path))
    assert np.array_equal(value, first.make()), "restored values differ"
    return {"s": seconds}


def _measure(row: str, count: int, path: str, package: str) -> dict:
    env = dict(os.environ, PYTHONPATH=package, TF_CPP_MIN_LOG_LEVEL="2")
    steal0, total0 = L.cpu_times()
    cmd = [sys.executable, __file__, "--worker", row, "--count", str(count), "--path", path]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    steal1, total1 = L.cpu_times()
    res = {"row": row, "count": count, "load1": L.load1()}
    res["steal_pct"] = 100 * (steal1 - steal0) / max(1, total1 - total0)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    res.update(
        json.loads(lines[-1][7:]) if lines else {"error": f"rc {p.returncode}: {p.stderr[-2000:]}"}
    )
    return res


def _save_all(count: int, root: str, package: str) -> dict:
    """Saves the tree in every form (in a fresh process); returns the save seconds."""
    code = f"""
import os, sys, time, json, numpy as np, jax
sys.path.insert(0, {HERE!r})
import bench_small_leaves as B, common as C
import flax_orbax_plugin as fop
from peers.flax_msgpack import Adapter
specs = B.specs_for({count})
tree = C.build_jax_tree(specs, "single")
out = {{}}
for v in (1, 2):
    t = time.perf_counter(); fop.save({root!r} + f"/v{{v}}", tree, format_version=v, force=True)
    out[f"fop v{{v}} save"] = time.perf_counter() - t
t = time.perf_counter(); Adapter().save_async({root!r} + "/msgpack", tree).wait()
out["msgpack save"] = time.perf_counter() - t
C.raw_write({root!r} + "/raw", [np.asarray(x) for x in jax.tree.leaves(tree)])
print("RESULT " + json.dumps(out))
"""
    env = dict(os.environ, PYTHONPATH=f"{package}:{HERE}", TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(lines[-1][7:])


def _path(root: str, row: str) -> str:
    if row.startswith("fop"):
        return os.path.join(root, row.split()[1])
    return os.path.join(root, row.split()[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--counts", default="6000,60000")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--package", default=os.path.dirname(HERE), help="the tree to import")
    p.add_argument("--before", help="another tree (e.g. main) whose fop rows run beside")
    p.add_argument("--out", default="small_leaves")
    p.add_argument("--no-save", dest="save", action="store_false", help="reuse the saved trees")
    p.add_argument("--worker")
    p.add_argument("--count", type=int)
    p.add_argument("--path")
    a = p.parse_args(argv)
    if a.worker:
        a.row = a.worker
        print("RESULT " + json.dumps(worker(a)), flush=True)
        return
    results = {"package": a.package, "saves": {}, "rows": []}
    for count in [int(x) for x in a.counts.split(",")]:
        root = os.path.join(C.TMP, f"small_leaves_{count}")
        os.makedirs(root, exist_ok=True)
        results["saves"][count] = _save_all(count, root, a.package) if a.save else {}
        for _ in range(a.repeats):  # interleaved: every row once per repeat
            for row in ROWS:
                for name, package in [("", a.package), *([("before", a.before)] * bool(a.before))]:
                    if name and not row.startswith("fop"):
                        continue
                    r = _measure(row, count, _path(root, row), package)
                    r["row"] = f"{row} ({name})" if name else row
                    print(json.dumps(r), flush=True)
                    results["rows"].append(r)
    with open(os.path.join(C.RESULTS, a.out + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    _report(results, os.path.join(C.RESULTS, a.out))


def _report(results: dict, base: str) -> None:
    counts = sorted({r["count"] for r in results["rows"]})
    rows = list(dict.fromkeys(r["row"] for r in results["rows"]))
    med = {
        (row, n): C.median(
            [r["s"] for r in results["rows"] if (r["row"], r["count"]) == (row, n) and "s" in r]
        )
        for row in rows
        for n in counts
    }
    lines = ["| row | " + " | ".join(f"{n} leaves (s, x raw)" for n in counts) + " |"]
    lines.append("|---|" + "---|" * len(counts))
    for row in rows:
        cells = []
        for n in counts:
            s, raw = med[(row, n)], med[("raw", n)]
            cells.append("-" if s is None else f"{s:.3f} ({s / raw:.2f}x)" if raw else f"{s:.3f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    for n in counts:
        saves = ", ".join(f"{k} {v:.2f} s" for k, v in results["saves"].get(n, {}).items())
        at_n = [r for r in results["rows"] if r["count"] == n]
        load = C.median([r["load1"] for r in at_n])
        steal = C.median([r["steal_pct"] for r in at_n])
        lines.append(f"\n{n} leaves: saves {saves}; load1 median {load:.2f}, steal {steal:.1f}%")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        ys = [med[(row, n)] for n in counts]
        ax.plot(counts, ys, marker="o", label=row)
    ax.set_xscale("log")
    ax.set_xlabel("leaves (same ~193 MB in all)")
    ax.set_ylabel("cold restore, s (one run)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=100)


if __name__ == "__main__":
    main()
