"""Issue 16, point 4: what per-item zstd compression costs and saves, through the library.

    python benchmarks/bench_compression.py [--max-mb 150] [--codecs none,zstd:1,zstd:3]
        [--workloads ab] [--repeats 3] [--format-versions 1,2]

For each workload (see common.py: (a) transformer-shaped training state, (b) ~6,000
small arrays; ``--max-mb`` takes a prefix of its leaves, in order: params, then mu,
then nu, so the run fits a shared machine) and each codec, saves the tree with
``fop.save(path, tree, compression=...)`` (durable and committed) and restores it with
``fop.restore`` (warm: the page cache is kept, so this measures decompression and
checksums, not the disk). Reports bytes on disk, the median save and restore times of
``--repeats`` runs, and checks every restore bit for bit. Codecs alternate within
each repeat so machine noise hits them alike. The benchmarks' values are random
floats, about the worst case for compression; optimizer moments of a real run and
integer or low-precision leaves compress better.

``--format-versions``: the on-disk format versions to compare (FORMAT.md; default 1),
alternated like the codecs. Writes benchmarks/results/compression.{json,md}
(compression_v2.{json,md} when more than version 1 is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402


def _tree(workload: str, max_bytes: float) -> dict:
    tree, total = {}, 0
    for spec in common.tree_specs(workload):
        if total + spec.nbytes > max_bytes and tree:
            break
        tree["/".join(spec.path)] = spec.make()
        total += spec.nbytes
    return tree


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def measure(tree: dict, codec: str | None, workdir: str, version: int = 1) -> dict:
    path = os.path.join(workdir, f"c-{codec or 'none'}-v{version}")
    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    fop.save(path, tree, compression=codec, format_version=version)
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    back = fop.restore(path)
    restore_s = time.perf_counter() - t
    ok = all(back[k].tobytes() == v.tobytes() for k, v in tree.items())
    out = {"save_s": save_s, "restore_s": restore_s, "disk": _disk_bytes(path), "ok": ok}
    shutil.rmtree(path, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mb", type=float, default=150)
    ap.add_argument("--codecs", default="none,zstd:1,zstd:3")
    ap.add_argument("--workloads", default="ab")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--format-versions", default="1")
    a = ap.parse_args(argv)
    versions = [int(v) for v in a.format_versions.split(",")]
    codecs = [(None if c == "none" else c, v) for c in a.codecs.split(",") for v in versions]
    rows = []
    workdir = tempfile.mkdtemp(prefix="fop-compression-", dir=os.environ.get("FOP_BENCH_TMP"))
    try:
        for w in a.workloads:
            tree = _tree(w, a.max_mb * 1e6)
            nbytes = sum(v.nbytes for v in tree.values())
            runs: dict = {c: [] for c in codecs}
            for _ in range(a.repeats):
                for c in codecs:
                    runs[c].append(measure(tree, c[0], workdir, c[1]))
            for c in codecs:
                rs = runs[c]
                rows.append(
                    {
                        "workload": w,
                        "codec": c[0] or "none",
                        "format": c[1],
                        "leaves": len(tree),
                        "bytes": nbytes,
                        "disk": rs[0]["disk"],
                        "save_s": statistics.median(r["save_s"] for r in rs),
                        "restore_s": statistics.median(r["restore_s"] for r in rs),
                        "ok": all(r["ok"] for r in rs),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(common.RESULTS, exist_ok=True)
    name = "compression" if versions == [1] else "compression_v2"
    with open(os.path.join(common.RESULTS, f"{name}.json"), "w") as f:
        json.dump({"rows": rows, "machine": common.machine_description()}, f, indent=1)
    lines = [
        "# Per-item zstd compression (issue 16), through `fop.save(compression=...)`",
        "",
        f"Medians of {a.repeats} runs, up to {a.max_mb:g} MB of each workload's leaves; "
        "restores warm (decompression and checksums, not the disk); every restore checked "
        "bit for bit. Random float values: near the worst case for compression.",
        "",
        "| workload | codec | format | leaves | MB | on disk | vs none | save s | restore s "
        "| checked |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["workload"], r["format"]): r["disk"] for r in rows if r["codec"] == "none"}
    for r in rows:
        key = (r["workload"], r["format"])
        ratio = r["disk"] / base[key] if key in base else float("nan")
        lines.append(
            f"| {r['workload']} | {r['codec']} | {r['format']} | {r['leaves']} | "
            f"{r['bytes'] / 1e6:.0f} | "
            f"{r['disk'] / 1e6:.1f} MB | {ratio:.3f}x | {r['save_s']:.3f} | "
            f"{r['restore_s']:.3f} | {'ok' if r['ok'] else 'MISMATCH'} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(common.RESULTS, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
