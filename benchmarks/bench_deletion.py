"""Deletion never delays a save: a save and the step after it, with and without a deletion.

    python benchmarks/bench_deletion.py [--leaves 220] [--saves 8] [--rounds 3]
                                        [--markdown PATH]

A moto S3 server in a child process (``tests/support/_s3_server.py``, ``mode="process"``:
its request handling off this process's GIL) and a ``CheckpointManager`` on a fresh
bucket per run, saving format version 1 (one zarr.json and chunk objects per leaf) a
tree of ``--leaves`` small leaves: 400+ objects per step (the count is printed).

Two cases, run alternately in one process, ``--rounds`` times each:

* ``no deletion``: ``keep`` unset, nothing is deleted;
* ``deleting``: ``keep=1``: each commit queues the removal of the previous step (its
  400+ objects), which runs on the deletion thread while the next save and "train
  step" run; on S3 by DeleteObjects batches (``_storage/deleting.py``);
* ``deleting, single``: the same with one delete request per object (the batch delete
  switched off in this process: what a store without one, or no botocore, gets).

Beside the per-save figures, the time a removal of one step took (from the commit that
queued it to its end, as the deletion thread saw it: ``StepsRemoved``'s time is not
recorded, so the removal is timed around ``_removing.remove_step``).

Per save (async: the blocking phase returns, the write and commit go on behind): the
blocking time of ``mngr.save``, the time of the "train step" right after it (a fixed
numpy workload, ~50 ms), and the time until the save is committed (``wait`` on its
handle through the manager's in-flight save). The first save of each run is left out
(nothing to delete yet). Medians and quartiles over every measured save, and whether a deletion was
in flight when the save started. Beside each case: the 1-minute load (``/proc/loadavg``)
and the share of CPU time stolen (``/proc/stat``) during it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _s3_server import S3Server  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from machine_load import cpu_times, load1  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402
from flax_orbax_plugin._core import removing as _removing  # noqa: E402
from flax_orbax_plugin._storage import deleting as _deleting  # noqa: E402


def _median_iqr(values: list[float]) -> str:
    """``median [p25-p75]``: the spread says what "within noise" means here."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{q[1]:.0f} [{q[0]:.0f}-{q[2]:.0f}]"


def tree(leaves: int, step: int) -> dict:
    """Small leaves sharded over the 8 CPU devices: partitioned leaves are never batched,
    so each is a zarr.json and chunk objects of its own."""
    sharding = NamedSharding(jax.make_mesh((8,), ("d",)), P("d"))
    host = np.arange(8 * 512, dtype=np.float32)
    return {
        "params": {f"l{i:04d}": jax.device_put(host + (step + i), sharding) for i in range(leaves)}
    }


def train_step(work: np.ndarray) -> float:
    t = time.perf_counter()
    for _ in range(4):
        work = np.tanh(work @ work.T / work.shape[0])
    return time.perf_counter() - t


REMOVALS: list[float] = []  # seconds per step removal, this process (see the docstring)


def _timed_removals() -> None:
    """Times every ``remove_step`` (the retention runner looks it up on the module)."""
    original = _removing.remove_step

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            REMOVALS.append(time.perf_counter() - t)

    _removing.remove_step = timed


def one_run(server: S3Server, case: str, leaves: int, saves: int) -> dict:
    bucket = server.create_bucket()
    loc = server.location(bucket, "run")
    keep = 1 if case.startswith("deleting") else None
    batch = _deleting.batch_deleter
    if case == "deleting, single":
        _deleting.batch_deleter = lambda loc: None
    del REMOVALS[:]
    work = np.random.default_rng(0).random((800, 800), dtype=np.float32)
    rows = []
    with fop.CheckpointManager(loc.url, keep=keep, async_save=True, format_version=1) as mngr:
        for step in range(1, saves + 1):
            retainer = mngr._retainer  # is a removal running now?
            deleting = retainer._last is not None and not retainer._last.done()
            state = tree(leaves, step)
            t = time.perf_counter()
            mngr.save(step, state)
            blocking = time.perf_counter() - t
            after = train_step(work)
            mngr._wait_inflight()  # committed; retention not waited
            committed = time.perf_counter() - t
            if step > 1:
                rows.append((blocking, after, committed, deleting))
        objects = len([k for k in loc.keys() if k.startswith(f"{saves}/")])
    _deleting.batch_deleter = batch
    return {"rows": rows, "objects": objects, "removals": list(REMOVALS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=50)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    cases = ("no deletion", "deleting", "deleting, single")
    found = {c: {"rows": [], "load": [], "steal": [], "objects": 0, "removals": []} for c in cases}
    _timed_removals()
    with S3Server(mode="process") as server:
        undo = server.apply_env()
        try:
            one_run(server, "no deletion", 10, 2)  # warm up: imports, first requests
            for _ in range(args.rounds):
                for case in cases:
                    steal0, total0 = cpu_times()
                    run = one_run(server, case, args.leaves, args.saves)
                    steal1, total1 = cpu_times()
                    f = found[case]
                    f["rows"] += run["rows"]
                    f["removals"] += run["removals"]
                    f["objects"] = run["objects"]
                    f["load"].append(load1())
                    f["steal"].append(100 * (steal1 - steal0) / max(1, total1 - total0))
        finally:
            undo()
    lines = [
        f"objects per step: {found['deleting']['objects']} ({args.leaves} leaves, format 1); "
        f"{args.rounds} runs x {args.saves - 1} measured saves per case",
        "",
        "| case (median [p25-p75]) | save blocking (ms) | train step after it (ms) "
        "| save committed (ms) "
        "| deletion in flight at save | removal of a step (ms) | load 1 min | steal % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        f = found[case]
        cells = [_median_iqr([r[i] * 1000 for r in f["rows"]]) for i in range(3)]
        busy = sum(r[3] for r in f["rows"])
        removal = _median_iqr([x * 1000 for x in f["removals"]]) if f["removals"] else "-"
        lines.append(
            f"| {case} | {' | '.join(cells)} | {busy}/{len(f['rows'])} | {removal} "
            f"| {statistics.median(f['load']):.2f} | {statistics.median(f['steal']):.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
