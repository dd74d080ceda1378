"""Host memory a save holds beyond the state (issue 26, point 4), and its blocking time.

Workload (a), ~1.2 GB on CPU, one fresh process per mode and repeat (orders rotated):
a manager saves the state, the training step (donating, as in ``train_loop.py``) runs
at once, then the save is waited for. Peak RSS above the RSS just before the save
(state built, step compiled, one unmeasured save first so pooled buffers exist where a
mode keeps them) is what the save cost in host memory, the step's own outputs
included: a step whose donation a save blocks allocates a second state.

Modes: ``pooled`` (the manager's default: one host copy kept between saves),
``views`` (``reuse_host_buffers=False``: CPU arrays held as views until written),
``budget`` (``host_memory_budget=256 MiB``: written from the state's own memory before
the save returns). Writes ``results/save_memory.{json,md}``.

    python benchmarks/bench_save_memory.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402

MODES = {
    "pooled": {},
    "views": {"reuse_host_buffers": False},
    "budget": {"host_memory_budget": 256 << 20},
}


def child(mode: str, directory: str) -> dict:
    import jax
    import numpy as np
    import train_loop as T

    import flax_orbax_plugin as fop

    C.rmtree(directory)
    state, step = T.build(C.tree_specs("a"))
    x = jax.device_put(np.random.default_rng(0).random((12, 25600), dtype=np.float32))
    state, loss = step(state, x)
    loss.block_until_ready()
    with fop.CheckpointManager(directory, keep=2, **MODES[mode]) as mngr:
        mngr.save(0, T.as_tree(state))  # unmeasured: pools filled, code paths warm
        state, loss = step(state, x)
        loss.block_until_ready()
        mngr.wait()
        base = C.rss_bytes()
        C.reset_peak_rss()
        t0 = time.perf_counter()
        mngr.save(1, T.as_tree(state))
        blocking = time.perf_counter() - t0
        state, loss = step(state, x)
        loss.block_until_ready()
        step_s = time.perf_counter() - t0 - blocking
        mngr.wait()
        total = time.perf_counter() - t0
        peak = C.peak_rss_bytes()
    C.rmtree(directory)
    state_bytes = C.total_bytes(C.tree_specs("a"))
    return {
        "mode": mode,
        "state_mib": state_bytes / 2**20,
        "extra_peak_mib": (peak - base) / 2**20,
        "blocking_s": blocking,
        "step_after_s": step_s,
        "total_s": total,
    }


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--dir", default=os.path.join(C.TMP, "save_memory"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(HERE, "results", "save_memory"))
    a = p.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.dir)), flush=True)
        return
    runs, loads = [], []
    for k in range(a.repeats):
        for mode in a.modes[k % len(a.modes) :] + a.modes[: k % len(a.modes)]:
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            cmd = [sys.executable, __file__, "--child", mode, "--dir", a.dir]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            loads.append(os.getloadavg()[0])
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            r = json.loads(line[-1][7:]) if line else {"mode": mode, "error": out.stderr[-2000:]}
            runs.append(r)
            print(k, mode, {k2: v for k2, v in r.items() if k2 != "error"}, flush=True)
    rows = []
    for mode in a.modes:
        ok = [r for r in runs if r["mode"] == mode and "extra_peak_mib" in r]
        if ok:
            row = {"mode": mode, "n": len(ok), "options": MODES[mode]}
            for key in ("extra_peak_mib", "blocking_s", "step_after_s", "total_s", "state_mib"):
                row[key] = statistics.median(r[key] for r in ok)
            rows.append(row)
    md = [
        "# Host memory of a save beyond the state (issue 26, point 4)",
        "",
        f"Workload (a) on CPU, {rows[0]['state_mib']:.0f} MiB; a manager save, the donating "
        f"step at once, then the wait; {a.repeats} repeats in fresh processes, orders rotated, "
        f"medians; load averages {min(loads):.1f}-{max(loads):.1f}. Extra peak RSS: peak RSS "
        "above the RSS just before the save (the step's own outputs included).",
        "",
        "| mode | options | extra peak RSS MiB | blocking s | step after s | save total s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['mode']} | `{json.dumps(r['options'])}` | {r['extra_peak_mib']:.0f} | "
            f"{r['blocking_s']:.3f} | {r['step_after_s']:.3f} | {r['total_s']:.3f} |"
        )
    with open(a.out + ".json", "w") as f:
        json.dump({"machine": C.machine_description(), "rows": rows, "runs": runs}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
