"""Medians of an A/B run of benchmarks/ab.sh: the plugin's figures per version.

    python benchmarks/ab_report.py OUT_DIR

For each workload and figure: the median over rounds of the plugin's time for A and
for B, and B/A; the core benchmark's figures also as ratios to the raw limit measured
in the same run (less sensitive to the machine's drift than the times themselves).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

FIGURES = ("blocking_s", "save_s", "restore_s", "params_s")


def _load(out: str, label: str, kind: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(out, f"{label}-*-{kind}.json")))
    return [json.load(open(p)) for p in paths]


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main(out: str) -> int:
    print("| workload | figure | A | B | B/A | A x raw | B x raw |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("core", "peers"):
        runs = {label: _load(out, label, kind) for label in ("A", "B")}
        workloads = sorted({w for r in runs["A"] for w in r["summary"]})
        for w in workloads:
            for fig in FIGURES:
                row = {}
                for label, docs in runs.items():
                    fop = [d["summary"].get(w, {}).get("fop", {}).get(fig) for d in docs]
                    raw = [d["summary"].get(w, {}).get("raw", {}).get(fig) for d in docs]
                    ratio = [f / r for f, r in zip(fop, raw, strict=True) if f and r]
                    row[label] = (_median(fop), _median(ratio))
                (a, ar), (b, br) = row["A"], row["B"]
                if a is None or b is None:
                    continue
                fmt = lambda x: "-" if x is None else f"{x:.3f}"
                print(f"| {w} | {fig} | {a:.3f} | {b:.3f} | {b / a:.2f} | {fmt(ar)} | {fmt(br)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
