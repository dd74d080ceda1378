"""Training loop with checkpoints against the same loop without (issue 26, target 1).

Each entry of ``--libs`` (``none`` is the run without saves; ``fop:{json}`` is the
plugin with manager options) runs ``train_loop.py`` once per repeat, each in a fresh
process; the order rotates every repeat, so drift on a shared machine hits all alike.
Reports, per entry, the median whole-run time and its ratio to the median of ``none``
from the same run, with the median blocking time and the median step right after a
save. Writes ``results/train.json`` and ``results/train.md``.

    python benchmarks/bench_train.py --repeats 3 --libs none fop fop-zc dcp orbax

``fop-zc`` is the plugin with its zero-copy step (``CheckpointManager.wrap_step``).
``ENTRY@DIR`` runs the package of the checkout at DIR (``PYTHONPATH``): two versions
side by side in one run, e.g. ``--libs none fop@/tmp/before fop@.``.
Beside each run: the load average before it and the whole VM's steal time during it
(``/proc/stat``).
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
from machine_load import cpu_times  # noqa: E402


def run_one(entry: str, a) -> dict:
    spec, _, code = entry.partition("@")  # lib[:options][@DIR]: the package from DIR
    lib, _, options = spec.partition(":")
    args = [sys.executable, os.path.join(HERE, "train_loop.py"), "--lib", lib]
    args += ["--dir", os.path.join(a.dir, "train"), "--steps", str(a.steps)]
    args += ["--every", str(a.every), "--keep", str(a.keep), "--batch", str(a.batch)]
    if options:
        args += ["--saver-options", options]
    if a.cpu_as_device:
        args += ["--cpu-as-device"]
    env = dict(os.environ, JAX_PLATFORMS=a.platform, PYTHONUNBUFFERED="1")
    if code:  # two checkouts side by side in one run (``fop@/tmp/before fop@.``)
        env["PYTHONPATH"] = os.path.abspath(code)
    load = os.getloadavg()[0]
    steal0, total0 = cpu_times()
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
    steal, total = cpu_times()
    steal_pct = round(100 * (steal - steal0) / max(1, total - total0), 2)  # whole VM
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r.update(entry=entry, load_before=load, steal_pct=steal_pct)
            return r
    return {"entry": entry, "error": f"exit {p.returncode}", "tail": p.stderr[-3000:]}


def _print(line: str) -> None:
    print(line, flush=True)


def run_rotated(entries: list[str], repeats: int, a, log=_print) -> tuple[list, list]:
    """Every entry once per repeat, each in a fresh process, the order rotated each
    repeat (drift on a shared machine then hits all alike); (runs, load averages)."""
    runs, loads = [], []
    for k in range(repeats):
        for entry in entries[k % len(entries) :] + entries[: k % len(entries)]:
            t0 = time.perf_counter()
            r = run_one(entry, a)
            loads.append(os.getloadavg()[0])
            runs.append(r)
            log(
                f"repeat {k} {entry}: total {r.get('total_s', r.get('error'))} "
                f"({time.perf_counter() - t0:.0f} s wall, load {loads[-1]:.1f})"
            )
    return runs, loads


def summarize(entries: list[str], runs: list[dict]) -> list[dict]:
    rows = []
    for e in entries:
        ok = [r for r in runs if r["entry"] == e and "total_s" in r]
        if not ok:
            rows.append({"entry": e, "error": [r.get("tail") for r in runs if r["entry"] == e]})
            continue
        row = {
            "entry": e,
            "n": len(ok),
            "total_median_s": statistics.median(r["total_s"] for r in ok),
            "totals_s": [round(r["total_s"], 3) for r in ok],
            "step_median_s": statistics.median(r["step_median_s"] for r in ok),
            "cpu_user_median_s": statistics.median(r["cpu_user_s"] for r in ok),
            "cpu_sys_median_s": statistics.median(r["cpu_sys_s"] for r in ok),
        }
        blocking = [b for r in ok for b in r.get("blocking_s", [])]
        after = [b for r in ok for b in r.get("after_save_s", [])]
        if blocking:
            row["blocking_median_s"] = statistics.median(blocking)
            row["after_save_median_s"] = statistics.median(after)
            row["final_wait_median_s"] = statistics.median(r["final_wait_s"] for r in ok)
        row["peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in ok)
        row["steal_pcts"] = [r.get("steal_pct") for r in ok]
        row["loads"] = [round(r.get("load_before", 0), 1) for r in ok]
        links = [r["pinned_host_gbps"] for r in ok if r.get("pinned_host_gbps")]
        if links:
            row["pinned_host_gbps"] = statistics.median(links)
        rows.append(row)
    base = next((r for r in rows if r["entry"] == "none" and "total_median_s" in r), None)
    for r in rows:
        if base and "total_median_s" in r:
            r["ratio"] = r["total_median_s"] / base["total_median_s"]
    return rows


def markdown(rows: list[dict], a, loads: list[float], machine: dict) -> str:
    out = [
        "# Training loop: whole run with checkpoints against without (issue 26)",
        "",
        f"Machine: {machine.get('cpu_count')} CPUs, load averages during the run "
        f"{min(loads):.1f}-{max(loads):.1f}. {a.steps} steps (batch {a.batch}), an async save "
        f"at the start of every {a.every}-th step (the first included), retention keeps "
        f"{a.keep}, the final save waited for; {a.repeats} repeats, each entry a fresh "
        "process, orders rotated; medians.",
        "",
        "| entry | total s (median) | ratio to none | step median s | blocking median s "
        "| step after save s | final wait s | CPU user/sys s | peak RSS MiB | totals "
        "| load before each | steal % of each |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "total_median_s" not in r:
            out.append(f"| {r['entry']} | error | | | | | | | | | | |")
            continue

        def f(k, fmt="{:.3f}", r=r):
            return fmt.format(r[k]) if k in r else "–"

        out.append(
            f"| {r['entry']} | {f('total_median_s')} | {f('ratio', '{:.3f}x')} | "
            f"{f('step_median_s')} | {f('blocking_median_s')} | {f('after_save_median_s')} | "
            f"{f('final_wait_median_s')} | {f('cpu_user_median_s', '{:.1f}')}/"
            f"{f('cpu_sys_median_s', '{:.1f}')} | {f('peak_rss_mib', '{:.0f}')} | {r['totals_s']} "
            f"| {r['loads']} | {r['steal_pcts']} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--libs", nargs="+", default=["none", "fop", "dcp", "orbax"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--dir", default=C.TMP)
    p.add_argument("--platform", default="cpu", help="JAX_PLATFORMS of the runs (cuda: GPU)")
    p.add_argument("--cpu-as-device", action="store_true", help="see train_loop.py")
    p.add_argument("--out", default=os.path.join(HERE, "results", "train"))
    a = p.parse_args(argv)
    runs, loads = run_rotated(a.libs, a.repeats, a)
    rows = summarize(a.libs, runs)
    machine = C.machine_description()
    with open(a.out + ".json", "w") as f:
        json.dump({"machine": machine, "args": vars(a), "rows": rows, "runs": runs}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(rows, a, loads, machine))
    print(markdown(rows, a, loads, machine))


if __name__ == "__main__":
    main()
