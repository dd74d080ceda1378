"""One process fails inside each collective operation: how long until every process raised.

    python benchmarks/bench_failure_propagation.py [--processes 2 4] [--repeats 5]
                                                   [--victim 1] [--markdown PATH]

Starts one job of N real JAX processes per repeat (``tests/support/_multiprocess.py``:
jax.distributed on 127.0.0.1, CPU devices, gloo) running
``tests/support/_failure_workers.py:one_fails_in_each``: for each collective operation
(a manager's open, save, restore and wait, ``fop.save`` / ``save_async`` /
``fop.restore`` onto a sharding over the processes, ``restore_params``), the processes
meet at a barrier, then process ``--victim`` fails inside it (a fault point before its
first coordination call there, or a bad input of its own) and every process must
raise. Two figures per operation (seconds; median and largest over the repeats): from
the start of the operation (every process leaves the barrier together; the victim fails
at its first coordination call in it, so this bounds the time from the failure) to the
last process raising, and from the victim raising to the last process raising (0 when
the victim raised last: it learnt of the others' view at an agreement first). The
coordination timeout is set to 120 s: a figure near it would mean the failure did not
propagate.

Beside each figure: the 1-minute load average (``/proc/loadavg``) at the end of the
job and the share of CPU time stolen by the hypervisor meanwhile (``/proc/stat``,
``steal``), since a loaded machine stretches every figure. Prints a markdown table
(and writes it to ``--markdown``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

from _failure_workers import FAULTS  # noqa: E402
from _multiprocess import run_processes  # noqa: E402
from machine_load import cpu_times, load1  # noqa: E402


def one_job(n: int, victim: int) -> tuple[dict[str, tuple[float, float]], float, float]:
    """One launch: {operation: (seconds from its start, and from the victim raising, to
    the last process raising)}, the load at its end, and the stolen CPU share meanwhile."""
    steal0, total0 = cpu_times()
    run = run_processes(
        "_failure_workers:one_fails_in_each",
        n,
        devices_per_process=2,
        args={
            "directory": tempfile.mkdtemp(prefix="fop-fail-"),
            "names": list(FAULTS),
            "victim": victim,
        },
        env={"FOP_COORDINATION_TIMEOUT_S": "120"},
        timeout_s=300,
    ).check()
    steal1, total1 = cpu_times()
    out = {}
    per_process = [p.result for p in run.procs]
    for i, name in enumerate(FAULTS):
        ops = [r[i] for r in per_process]
        bad = [p for p, op in enumerate(ops) if op["error"] == "returned"]
        if bad:
            raise AssertionError(f"{name}: process(es) {bad} did not raise")
        last = max(op["t_raised"] for op in ops)
        start = min(op["t0"] for op in ops)
        out[name] = (last - start, max(0.0, last - ops[victim]["t_raised"]))
    stolen = (steal1 - steal0) / max(1, total1 - total0)
    return out, load1(), stolen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    rows = []
    for n in args.processes:
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in FAULTS}
        loads, steals = [], []
        for _ in range(args.repeats):
            figures, load, stolen = one_job(n, args.victim)
            for name, seconds in figures.items():
                samples[name].append(seconds)
            loads.append(load)
            steals.append(stolen)
            said = {k: f"{a:.2f}/{b:.2f}" for k, (a, b) in figures.items()}
            print(f"{n} processes: {said} load {load:.2f} steal {stolen:.1%}", flush=True)
        for name, values in samples.items():
            start, after = [v[0] for v in values], [v[1] for v in values]
            rows.append(
                f"| {n} | {name} | {statistics.median(start):.2f} | {max(start):.2f} | "
                f"{statistics.median(after):.2f} | {max(after):.2f} | "
                f"{statistics.median(loads):.1f} | {statistics.median(steals):.1%} |"
            )
    table = "\n".join(
        [
            "| processes | operation | from start: median s | max s | after the victim "
            "raised: median s | max s | load (1 min) | steal |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
