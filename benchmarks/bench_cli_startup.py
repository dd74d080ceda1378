"""How long `flax-orbax --help`, `<command> --help` and `--version` take, before and after.

    python benchmarks/bench_cli_startup.py [--before REV] [--runs 5] [--json OUT]

Runs each case as `python -m flax_orbax_plugin ARGS` in a child process and reports the
median wall time of ``--runs`` runs, for this checkout ("after") and for the package as
it is at git revision REV (default ``main``; extracted with ``git archive`` into a
temporary directory: "before"). Two conditions:

- cold: every run with an empty bytecode cache (``PYTHONPYCACHEPREFIX`` set to a new
  temporary directory), so Python compiles every module it imports: the first run after
  an install or an upgrade (the OS page cache is not dropped: that needs root);
- warm: the bytecode cache filled by a first, untimed run, as on every later run.

A last row, ``import flax_orbax_plugin`` and a first use of ``fop.save``, is what a
command that reads or writes a checkpoint pays for JAX, tensorstore and the library
before it starts (the same before and after: it is moved, not removed). ``n/a``: the
case exits non-zero at that revision (``--version`` did not exist before).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = (
    ("--help", ["-m", "flax_orbax_plugin", "--help"]),
    ("--version", ["-m", "flax_orbax_plugin", "--version"]),
    ("verify --help", ["-m", "flax_orbax_plugin", "verify", "--help"]),
    ("import + first use of fop.save", ["-c", "import flax_orbax_plugin as f; f.save"]),
)


def _extract(rev: str, into: str) -> str:
    """The package at git revision ``rev``, written under ``into``; its root."""
    archive = os.path.join(into, "src.tar")
    with open(archive, "wb") as f:
        subprocess.run(
            ["git", "-C", REPO, "archive", rev, "flax_orbax_plugin"], stdout=f, check=True
        )
    root = os.path.join(into, "before")
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return root


def _run_once(root: str, argv: list[str], pycache: str) -> float:
    env = dict(os.environ, PYTHONPATH=root, PYTHONPYCACHEPREFIX=pycache)
    start = time.perf_counter()
    p = subprocess.run([sys.executable, *argv], env=env, cwd=root, capture_output=True)
    elapsed = time.perf_counter() - start
    if p.returncode != 0:
        return float("nan")  # e.g. --version before it existed: reported as n/a
    return elapsed


def _median(root: str, argv: list[str], runs: int, cold: bool, scratch: str) -> float:
    times = []
    warm_cache = tempfile.mkdtemp(dir=scratch)
    if not cold:
        _run_once(root, argv, warm_cache)  # fills the bytecode cache, untimed
    for _ in range(runs):
        cache = tempfile.mkdtemp(dir=scratch) if cold else warm_cache
        times.append(_run_once(root, argv, cache))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default="main", help="git revision to compare with")
    ap.add_argument("--runs", type=int, default=5, help="runs per case (the median is shown)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        roots = {"before": _extract(args.before, scratch), "after": REPO}
        for name, case in CASES:
            row = {"case": name}
            for label, root in roots.items():
                for cold in (True, False):
                    key = f"{label}_{'cold' if cold else 'warm'}_s"
                    row[key] = _median(root, case, args.runs, cold, scratch)
            results.append(row)
    print(f"median of {args.runs} runs, seconds; before = {args.before}, after = this checkout")
    header = ("case", "before cold", "before warm", "after cold", "after warm")
    print(f"{header[0]:32s}" + "".join(f"{h:>13s}" for h in header[1:]))
    for row in results:
        values = [row[k] for k in ("before_cold_s", "before_warm_s", "after_cold_s")]
        values.append(row["after_warm_s"])
        cells = "".join("          n/a" if v != v else f"{v:13.3f}" for v in values)
        print(f"{row['case']:32s}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": args.runs, "before": args.before, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
