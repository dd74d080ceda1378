"""Peak host memory against the ceiling on every path (issue 53), and the time each
ceiling costs.

One fresh child process per ceiling (tests/support/_host_memory_child.py): a state of
``--state-mib`` MiB on CPU (8 float32 leaves), then, in turn, fop.save
(``host_memory_budget``), a manager's save and restore (``host_memory``), a callback's
resume, restore_params (serve), to_safetensors (export) and import_msgpack (import),
each under the ceiling. Extra peak: the peak resident memory (VmHWM, reset before the
path) above the resident memory before it, less the bytes the path returns. Ceilings:
none (each path's default), 1/4 and 1/16 of the state. Writes
``results/host_memory.{json,md}``.

    python benchmarks/bench_host_memory.py --state-mib 512 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD = os.path.join(ROOT, "tests", "support", "_host_memory_child.py")
PATHS = ["save", "manager_save", "manager_restore", "resume", "serve", "export", "import"]
NONE = 1 << 62  # "no ceiling": larger than any state (the paths then take their defaults)


def run(state_mib: int, ceiling: int) -> dict:
    directory = tempfile.mkdtemp(prefix="fop-host-memory-")
    try:
        env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
        args = [sys.executable, CHILD, directory, str(ceiling), str(state_mib), ",".join(PATHS)]
        done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise RuntimeError(done.stderr[-3000:])
        return json.loads(line[-1][len("RESULT ") :])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state-mib", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args(argv)
    state = a.state_mib << 20
    ceilings = {"none": NONE, "1/4": state // 4, "1/16": state // 16}
    rows = []
    for label, ceiling in ceilings.items():
        runs = [run(a.state_mib, ceiling) for _ in range(a.repeats)]
        for path in PATHS:
            got = [r[path] for r in runs]
            error = got[0]["error"]
            rows.append(
                {
                    "ceiling": label,
                    "ceiling_mib": None if ceiling == NONE else ceiling / 2**20,
                    "path": path,
                    "extra_peak_mib": statistics.median(g["extra"] for g in got) / 2**20,
                    "seconds": statistics.median(g["seconds"] for g in got),
                    "refused": None if error is None else error.split(":")[0],
                }
            )
    out = os.path.join(HERE, "results")
    with open(os.path.join(out, "host_memory.json"), "w") as f:
        json.dump({"state_mib": a.state_mib, "repeats": a.repeats, "rows": rows}, f, indent=1)
    base = {r["path"]: r["seconds"] for r in rows if r["ceiling"] == "none"}
    lines = [
        "# Peak host memory against the ceiling (issue 53)",
        "",
        f"State: {a.state_mib} MiB on CPU (8 float32 leaves), one fresh process per ceiling, "
        f"{a.repeats} repeat(s), medians. Extra peak: peak RSS (VmHWM, reset before each path) "
        "above the RSS before it, less the bytes the path returns. Time: the path's, and its "
        "ratio to the same path under the ceiling 'none' (2**62 bytes: the saves stream, "
        "nothing else is bounded in effect).",
        "`python benchmarks/bench_host_memory.py`.",
        "",
        "| path | ceiling | ceiling MiB | extra peak MiB | s | x time of no ceiling | refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ceiling = "-" if r["ceiling_mib"] is None else f"{r['ceiling_mib']:.0f}"
        ratio = r["seconds"] / base[r["path"]] if base.get(r["path"]) else float("nan")
        lines.append(
            f"| {r['path']} | {r['ceiling']} | {ceiling} | {r['extra_peak_mib']:.1f} | "
            f"{r['seconds']:.2f} | {ratio:.2f} | {r['refused'] or ''} |"
        )
    with open(os.path.join(out, "host_memory.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
