"""Runs the matrix of (library x workload x repeat) in fresh worker processes,
takes medians, computes ratios, checks targets and writes JSON, Markdown and a PNG.

Used by ``bench_core.py`` (issue 2: the plugin against the raw limit) and
``bench_peers.py`` (issue 5: every library). Repeats are interleaved (rep 0 of every
library, then rep 1, ...) and the library order rotates each repeat, so drift on a
shared machine spreads over all libraries instead of landing on one.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C
from peers import LABELS

MiB = 1 << 20
RAW = ("raw", "raw1")  # the disk's limit: parallel streams (ratios' base), one stream


def restore_targets(workload: str) -> list[str]:
    return ["4x2", "single"] if workload == "c" else ["single"]


def params_target(workload: str) -> str:
    return "4x2" if workload == "c" else "single"


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def run_matrix(
    libs, workloads, repeats, *, params=True, verify=True, numpy_restore=False, streams=32
) -> list[dict]:
    """Every measurement as a list of worker result dicts (with 'rep').

    Values are verified on the first repeat (``verify``); every restore of every
    repeat checks its result's leaf types, shapes, dtypes and shardings."""
    rows = []
    for w in workloads:
        env = C.env_for_layout(w)
        base = os.path.join(C.TMP, w)
        for rep in range(repeats):
            order = libs[rep % len(libs) :] + libs[: rep % len(libs)]
            for lib in order:
                path = os.path.join(base, lib + (".bin" if lib in (*RAW, "msgpack") else ""))
                jobs = [["save", "--lib", lib, "--workload", w, "--path", path]]
                targets = restore_targets(w) if lib not in RAW else ["single"]
                if numpy_restore and lib == "fop":
                    targets = targets + ["numpy"]
                for t in targets:
                    jobs.append(
                        ["restore", "--lib", lib, "--workload", w, "--path", path, "--target", t]
                    )
                if params:
                    jobs.append(
                        [
                            "restore",
                            "--params",
                            "--lib",
                            lib,
                            "--workload",
                            w,
                            "--path",
                            path,
                            "--target",
                            params_target(w),
                        ]
                    )
                for j in jobs:
                    if lib == "raw":
                        j = j + ["--streams", str(streams)]
                    if verify and rep == 0 and j[0] == "restore" and lib not in RAW:
                        j = j + ["--verify"]
                    if j[0] == "save":  # every writer starts from memory touched before
                        C.warm_memory(2 * C.total_bytes(C.tree_specs(w)), base)
                    t0 = time.perf_counter()
                    r = C.run_worker(j, env)
                    r["rep"] = rep
                    r.setdefault("lib", lib)
                    r.setdefault("workload", w)
                    r.setdefault("op", "params" if "--params" in j else j[0])
                    if j[0] == "restore" and "target" not in r:
                        r["target"] = j[j.index("--target") + 1]
                    rows.append(r)
                    what = r.get("time_s", r.get("total_s"))
                    status = r.get("error", f"{what:.3f}s" if what is not None else "")
                    log(
                        f"{w} rep{rep} {lib:8s} {r['op']:8s} {r.get('target', ''):6s} "
                        f"{status} ({time.perf_counter() - t0:.1f}s wall)"
                    )
                    if "error" in r:
                        log(r.get("tail", "")[-1500:])
        C.rmtree(base)
    return rows


def run_train(libs, steps, every, rounds=2) -> list[dict]:
    """The training loop of ``bench_train.py``: each library and the run without saves
    (``none``) in a fresh process per repeat (``rounds``), orders rotated; a row per
    library with its whole-run time over the run without (medians), the target."""
    import argparse

    import bench_train as BT

    entries = ["none", *libs]
    a = argparse.Namespace(
        steps=steps, every=every, keep=2, batch=12, dir=C.TMP, cpu_as_device=False, platform="cpu"
    )
    runs, _ = BT.run_rotated(entries, rounds, a, log=lambda line: log(f"train {line}"))
    summary = {r["entry"]: r for r in BT.summarize(entries, runs)}
    base = summary.get("none", {})
    rows = []
    for lib in libs:
        r = summary.get(lib, {})
        if "total_median_s" not in r or "total_median_s" not in base:
            rows.append({"op": "train", "lib": lib, "error": "no run", "tail": str(r)[-2000:]})
            continue
        rows.append(
            {
                "op": "train",
                "lib": lib,
                "steps": steps,
                "every": every,
                "rounds": r["n"],
                "slowdown_total": r["ratio"],
                "slowdown_median": r["step_median_s"] / base["step_median_s"],
                "base_median_s": base["step_median_s"],
                "save_median_s": r["step_median_s"],
                "blocking_median_s": r.get("blocking_median_s"),
                "after_save_median_s": r.get("after_save_median_s"),
                "total_median_s": r["total_median_s"],
                "base_total_median_s": base["total_median_s"],
            }
        )
        log(f"train {lib}: total time {r['ratio']:.3f}x the run without saves")
    return rows


# ------------------------------------------------------------------- summary

FIGS = [
    # (key in summary, op, field, target or None)
    ("blocking_s", "save", "blocking_s", None),
    ("save_s", "save", "total_s", None),
    ("save_peak_rss", "save", "peak_rss_delta", None),
    ("disk_bytes", "save", "disk_bytes", None),
    ("restore_s", "restore", "time_s", "single"),
    ("restore_peak_rss", "restore", "peak_rss_delta", "single"),
    ("restore_read_bytes", "restore", "read_bytes", "single"),
    ("restore_4x2_s", "restore", "time_s", "4x2"),
    ("restore_4x2_peak_rss", "restore", "peak_rss_delta", "4x2"),
    ("restore_numpy_s", "restore", "time_s", "numpy"),
    ("restore_numpy_peak_rss", "restore", "peak_rss_delta", "numpy"),
    ("params_s", "params", "time_s", None),
    ("params_read_bytes", "params", "read_bytes", None),
    ("params_peak_rss", "params", "peak_rss_delta", None),
]


def summarize(rows: list[dict]) -> dict:
    """{workload: {lib: {fig: median}}}, plus the raw host-copy time and bytes."""
    out: dict = {}
    for r in rows:
        if "error" in r or r.get("op") == "train":
            continue
        w, lib = r["workload"], r["lib"]
        d = out.setdefault(w, {}).setdefault(lib, {"_samples": {}})
        for key, op, field, target in FIGS:
            if r["op"] != op or field not in r:
                continue
            if target is not None and r.get("target") != target:
                continue
            d["_samples"].setdefault(key, []).append(r[field])
        if r["op"] == "save":
            d["tree_bytes"] = r["tree_bytes"]
            for k in (
                "host_copy_s",
                "host_copy_numpy_s",
                "host_copy_warm_s",
                "fsync_pass_s",
                "residual_fsync_s",  # results of the harness before the uniform pass
                "harness_fsync_s",
            ):
                if k in r:
                    d["_samples"].setdefault(k, []).append(r[k])
            if "streams" in r:
                d["streams"] = r["streams"]
        if r["op"] == "restore" and r.get("target") == "single":
            d["restored_bytes"] = r["restored_bytes"]
        if r["op"] == "params":
            d["params_bytes"] = r["restored_bytes"]
        for flag in ("verified", "sharding_ok"):
            if flag in r:
                d.setdefault(flag, True)
                d[flag] = d[flag] and r[flag]
        if "checks_ok" in r:  # every restore result: types, shapes, dtypes, shardings
            d["checks_n"] = d.get("checks_n", 0) + 1
            d["checks_passed"] = d.get("checks_passed", 0) + bool(r["checks_ok"])
    for w in out.values():
        for d in w.values():
            samples = d.pop("_samples")
            for k, xs in samples.items():
                d[k] = C.median(xs)
                d[k + "_n"] = len(xs)
    return out


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _slowdown_total(r: dict):
    """Training-loop total time with saves / without (older results: slowdown_mean)."""
    return r.get("slowdown_total", r.get("slowdown_mean"))


def raw_limit(libs: dict) -> dict:
    """{figure: the fastest raw row's value} for save_s and restore_s, plus the
    parallel row's other fields (host copy, streams)."""
    par, one = libs.get("raw", {}), libs.get("raw1", {})
    out = dict(par)
    for k in ("save_s", "restore_s", "params_s"):
        vals = [d[k] for d in (par, one) if d.get(k) is not None]
        out[k] = min(vals) if vals else None
    return out


def ratios(summary: dict) -> dict:
    """{workload: {lib: {'save/raw', 'restore/raw', 'save/fop', 'restore/fop', ...}}}

    The raw limit of each figure is the faster of the two raw rows: the parallel one
    ('raw') wherever parallel streams help, else the single stream ('raw1'), so a
    ratio is never taken against a limit the disk beat."""
    out = {}
    for w, libs in summary.items():
        raw = raw_limit(libs)
        fop = libs.get("fop", {})
        out[w] = {}
        for lib, d in libs.items():
            out[w][lib] = {
                "save/raw": _ratio(d.get("save_s"), raw.get("save_s")),
                "restore/raw": _ratio(d.get("restore_s"), raw.get("restore_s")),
                "save/fop": _ratio(d.get("save_s"), fop.get("save_s")),
                "restore/fop": _ratio(d.get("restore_s"), fop.get("restore_s")),
                "blocking/hostcopy": _ratio(d.get("blocking_s"), raw.get("host_copy_s")),
            }
    return out


def _target(name, ok, measured, detail):
    return {
        "target": name,
        "status": "n/a" if ok is None else ("PASS" if ok else "MISS"),
        "measured": measured,
        "detail": detail,
    }


def rss_limit(nbytes):
    return 1.05 * nbytes + 64 * MiB


def core_targets(s: dict) -> list[dict]:
    """Issue 2's targets: the plugin against the raw limit."""
    t = []
    for w, lim_save, lim_rest in (("a", 1.1, 1.1), ("b", 2.0, 2.0)):
        if w not in s or "fop" not in s[w]:
            continue
        f, raw = s[w]["fop"], raw_limit(s[w])
        r = _ratio(f.get("save_s"), raw.get("save_s"))
        t.append(
            _target(
                f"({w}) durable save <= {lim_save}x raw write",
                None if r is None else r <= lim_save,
                r,
                f"{f.get('save_s')}s vs {raw.get('save_s')}s",
            )
        )
        r = _ratio(f.get("restore_s"), raw.get("restore_s"))
        t.append(
            _target(
                f"({w}) cold restore <= {lim_rest}x raw read",
                None if r is None else r <= lim_rest,
                r,
                f"{f.get('restore_s')}s vs {raw.get('restore_s')}s",
            )
        )
        hc = raw.get("host_copy_s")
        b = f.get("blocking_s")
        ok = None if hc is None or b is None else b <= hc + 0.020
        t.append(
            _target(
                f"({w}) async blocking <= one host copy (same allocator) + 20 ms",
                ok,
                _ratio(b, hc),
                f"blocking {b}s, host copy {hc}s",
            )
        )
        rss, nb = f.get("restore_peak_rss"), f.get("restored_bytes")
        ok = None if rss is None or nb is None else rss <= rss_limit(nb)
        t.append(
            _target(
                f"({w}) restore peak RSS <= 1.05 x bytes + 64 MiB",
                ok,
                _ratio(rss, nb),
                f"{_mib(rss)} MiB vs limit {_mib(rss_limit(nb or 0))} MiB",
            )
        )
    return t


def peer_targets(s: dict, train: list[dict]) -> list[dict]:
    """Issue 5's targets."""
    t = []
    peers = ("orbax", "dcp", "msgpack")
    a = s.get("a", {})
    if "fop" in a:
        f, raw = a["fop"], raw_limit(a)
        for fig, rawfig in (("save_s", "save_s"), ("restore_s", "restore_s")):
            r = _ratio(f.get(fig), raw.get(rawfig))
            best = min((a[p][fig] for p in peers if p in a and a[p].get(fig)), default=None)
            ok = None if r is None else (r <= 1.1 and (best is None or f[fig] < best))
            t.append(
                _target(
                    f"(a) {fig[:-2]} <= 1.1x raw and faster than the fastest peer",
                    ok,
                    r,
                    f"fop {f.get(fig)}s, raw {raw.get(rawfig)}s, fastest peer {best}s",
                )
            )
    b = s.get("b", {})
    if "fop" in b:
        f = b["fop"]
        for fig in ("save_s", "restore_s"):
            for p, k in (("orbax", 5.0), ("dcp", 2.0)):
                if p not in b:
                    continue
                sp = _ratio(b[p].get(fig), f.get(fig))
                t.append(
                    _target(
                        f"(b) {fig[:-2]} >= {k}x faster than {p}",
                        None if sp is None else sp >= k,
                        sp,
                        f"{p} {b[p].get(fig)}s / fop {f.get(fig)}s",
                    )
                )
    for w in ("a", "b", "c"):
        if w in s and "fop" in s[w]:
            f = s[w]["fop"]
            rb, pb = f.get("params_read_bytes"), f.get("params_bytes")
            r = _ratio(rb, pb)
            t.append(
                _target(
                    f"({w}) params-only restore reads within 5% of params bytes",
                    None if r is None else r <= 1.05,
                    r,
                    f"{rb} read / {pb} params",
                )
            )
    for w in ("a", "b"):
        if w in s and "fop" in s[w]:
            f = s[w]["fop"]
            rss, nb = f.get("restore_peak_rss"), f.get("restored_bytes")
            others = {p: s[w][p].get("restore_peak_rss") for p in peers if p in s[w]}
            ok = None
            if rss is not None and nb:
                ok = rss <= rss_limit(nb) and all(v is None or rss < v for v in others.values())
            t.append(
                _target(
                    f"({w}) restore peak RSS <= 1.05x bytes + 64 MiB, below every peer",
                    ok,
                    _ratio(rss, nb),
                    f"fop {_mib(rss)} MiB, limit "
                    f"{_mib(rss_limit(nb or 0))} MiB, peers "
                    + ", ".join(f"{p} {_mib(v)}" for p, v in others.items()),
                )
            )
    for r in train:
        if r.get("lib") == "fop" and _slowdown_total(r) is not None:
            sd = _slowdown_total(r)
            others = {
                x["lib"]: _slowdown_total(x)
                for x in train
                if x.get("lib") != "fop" and _slowdown_total(x) is not None
            }
            t.append(
                _target(
                    "training loop with background saves: total time <= 1.10x without, "
                    "below every peer",
                    sd <= 1.10 and all(sd < v for v in others.values()),
                    sd,
                    f"total {sd:.2f}x (blocking, overlap and final wait included); "
                    f"median step {r['slowdown_median']:.2f}x; peers' total: "
                    + ", ".join(f"{p} {v:.2f}x" for p, v in others.items()),
                )
            )
    return t


def _mib(x):
    return None if x is None else round(x / MiB, 1)


def _fmt(x, kind):
    if x is None:
        return "–"
    if kind == "s":
        return f"{x:.3f}"
    if kind == "b":
        return f"{x / MiB:.0f}"
    if kind == "x":
        return f"{x:.2f}x"
    return str(x)


def markdown(summary, rat, targets, train, machine, title, notes=()) -> str:
    lines = [f"# {title}", ""]
    v = machine.get("versions", {})
    lines.append(
        f"Machine: {machine.get('cpu_count')} CPUs ({machine.get('cpu_model', '?')}), "
        f"{(machine.get('ram_bytes') or 0) / (1 << 30):.0f} GiB RAM, disk `{machine.get('disk')}`; "
        + ", ".join(f"{k} {val}" for k, val in v.items() if val)
        + f"; plugin at commit {machine.get('plugin_commit')}; THP {machine.get('thp_enabled')}, "
        f"NUMPY_MADVISE_HUGEPAGE={machine.get('NUMPY_MADVISE_HUGEPAGE')}"
    )
    lines.append("")
    lines.append(
        "Times in seconds, sizes in MiB; each figure is the median of the repeats "
        "(n in the JSON). RSS is peak RSS above the process's RSS just before the "
        "operation. Restores are cold (page cache dropped)."
    )
    lines.append("")
    cols = [
        ("blocking_s", "async blocking s", "s"),
        ("save_s", "durable save s", "s"),
        ("restore_s", "cold restore s", "s"),
        ("restore_4x2_s", "restore 4x2 s", "s"),
        ("restore_numpy_s", "restore to numpy s", "s"),
        ("restore_numpy_peak_rss", "numpy restore RSS MiB", "b"),
        ("params_s", "params-only s", "s"),
        ("params_read_bytes", "params read MiB", "b"),
        ("save_peak_rss", "save RSS MiB", "b"),
        ("restore_peak_rss", "restore RSS MiB", "b"),
        ("disk_bytes", "on disk MiB", "b"),
    ]
    rcols = [
        ("save/raw", "save/raw"),
        ("restore/raw", "restore/raw"),
        ("save/fop", "save/fop"),
        ("restore/fop", "restore/fop"),
    ]
    for w, libs in summary.items():
        lines.append(f"## Workload ({w}): {C.WORKLOADS[w]}")
        lines.append("")
        any_tree = next(iter(libs.values()))
        lines.append(
            f"Tree: {any_tree.get('tree_bytes', 0) / MiB:.0f} MiB; params "
            f"{(any_tree.get('params_bytes') or 0) / MiB:.0f} MiB. "
            + (
                f"One host copy of the tree: {libs['raw'].get('host_copy_s', 0):.3f} s "
                "(fresh memory from the allocator the plugin's snapshot uses: the "
                "raw rows' blocking column and the blocking target's reference), "
                f"{libs['raw'].get('host_copy_numpy_s') or 0:.3f} s (numpy's allocator, "
                f"huge pages), {libs['raw'].get('host_copy_warm_s', 0):.3f} s "
                "(into reused memory). Ratios to raw are to the faster raw row of "
                f"each figure (parallel: {libs['raw'].get('streams', '?')} streams)."
                if "raw" in libs
                else ""
            )
        )
        lines.append("")
        hdr = ["library"] + [
            c[1] for c in cols if any(d.get(c[0]) is not None for d in libs.values())
        ]
        keys = [c for c in cols if any(d.get(c[0]) is not None for d in libs.values())]
        hdr += [r[1] for r in rcols] + ["result checks"]
        lines.append("| " + " | ".join(hdr) + " |")
        lines.append("|" + "---|" * len(hdr))
        for lib in ["raw", "raw1", "fop", "orbax", "dcp", "msgpack"]:
            if lib not in libs:
                continue
            d = libs[lib]
            label = LABELS.get(lib, lib)
            if lib == "raw":
                label = f"{label}, {d.get('streams', '?')} streams"
            cells = [label] + [_fmt(d.get(k), kind) for k, _, kind in keys]
            cells += [_fmt(rat[w][lib].get(k), "x") for k, _ in rcols]
            n, ok = d.get("checks_n"), d.get("checks_passed")
            cells.append("–" if not n else f"{ok}/{n}" + ("" if ok == n else " **FAIL**"))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if train:
        lines.append("## Training loop: total time with background saves vs none")
        lines.append("")
        lines.append(
            "Total time: the whole run (every step, every save from the first, blocking "
            "and retention included, the final save waited for) over the same run "
            "without saves, each library and the run without in a fresh process per "
            "repeat, orders rotated, medians (bench_train.py); the median step is the "
            "second figure."
        )
        lines.append("")
        lines.append(
            "| library | steps x repeats | save every | slowdown (total time) | "
            "slowdown (median step) | base median s | with saves median s | "
            "blocking median s |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in train:
            if "error" in r:
                lines.append(f"| {LABELS.get(r['lib'], r['lib'])} | error: {r['error']} |")
                continue
            lines.append(
                f"| {LABELS.get(r['lib'], r['lib'])} | {r['steps']} x {r.get('rounds', 1)} | "
                f"{r['every']} | {_slowdown_total(r) or 0:.2f}x | "
                f"{r.get('slowdown_median', 0):.2f}x | "
                f"{r['base_median_s']:.3f} | {r.get('save_median_s', 0):.3f} | "
                f"{r.get('blocking_median_s', 0):.3f} |"
            )
        lines.append("")
    lines.append("## Targets")
    lines.append("")
    lines.append("| target | status | measured ratio | detail |")
    lines.append("|---|---|---|---|")
    for t in targets:
        m = t["measured"]
        lines.append(
            f"| {t['target']} | **{t['status']}** | "
            f"{'–' if m is None else f'{m:.2f}'} | {t['detail']} |"
        )
    lines.append("")
    if notes:
        lines.append("## Notes")
        lines.append("")
        lines += [f"- {n}" for n in notes]
        lines.append("")
    return "\n".join(lines)


def chart(rat: dict, path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ws = list(rat)
    fig, axes = plt.subplots(1, len(ws), figsize=(5 * len(ws), 4), squeeze=False)
    for ax, w in zip(axes[0], ws, strict=True):
        libs = [lib for lib in ("fop", "orbax", "dcp", "msgpack") if lib in rat[w]]
        xs = range(len(libs))
        sv = [rat[w][lib]["save/raw"] or 0 for lib in libs]
        rs = [rat[w][lib]["restore/raw"] or 0 for lib in libs]
        ax.bar([x - 0.2 for x in xs], sv, 0.4, label="save / raw write")
        ax.bar([x + 0.2 for x in xs], rs, 0.4, label="restore / raw read")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(libs)
        ax.set_yscale("log")
        ax.set_title(f"workload ({w})")
        ax.set_ylabel("x raw limit (log, lower is better)")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(stem, title, rows, train, targets_fn, notes=(), config=None, machine=None):
    os.makedirs(C.RESULTS, exist_ok=True)
    summary = summarize(rows)
    rat = ratios(summary)
    targets = targets_fn(summary, train)
    machine = machine or C.machine_description()
    md = markdown(summary, rat, targets, train, machine, title, notes)
    png = chart(rat, os.path.join(C.RESULTS, stem + ".png"), title)
    if png:
        md += f"\n![ratios to the raw limit]({os.path.basename(png)})\n"
    with open(os.path.join(C.RESULTS, stem + ".md"), "w") as f:
        f.write(md)
    with open(os.path.join(C.RESULTS, stem + ".json"), "w") as f:
        json.dump(
            {
                "title": title,
                "config": config or {},
                "machine": machine,
                "node": platform.node(),
                "summary": summary,
                "ratios": rat,
                "targets": targets,
                "train": train,
                "runs": rows,
            },
            f,
            indent=1,
            default=str,
        )
    print()
    print(md)
    print()
    for t in targets:
        m = t["measured"]
        print(f"{t['status']:5s} {t['target']}: {'-' if m is None else f'{m:.2f}'} ({t['detail']})")
    print(f"\nwrote {C.RESULTS}/{stem}.json, .md" + (", .png" if png else ""))
    failed = [r for r in [*rows, *train] if "error" in r]
    failed += [r for r in rows if r.get("checks_ok") is False]
    if failed:
        print(f"\n{len(failed)} measurement(s) failed or returned a wrong result:")
        for r in failed:
            print(
                " ",
                r.get("lib"),
                r.get("workload"),
                r.get("op"),
                r.get("target", ""),
                r.get("error") or r.get("check_problems"),
            )
    return summary, targets, failed
