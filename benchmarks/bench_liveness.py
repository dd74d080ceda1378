"""A process killed mid-save: how long until every other process raised, naming it;
and what the heartbeat costs.

    python benchmarks/bench_liveness.py [--processes 2 4] [--repeats 3]
                                        [--silent 10] [--saves 5] [--markdown PATH]

Starts N real JAX processes per repeat (``tests/support/_multiprocess.py``:
jax.distributed on 127.0.0.1, CPU devices, gloo) running
``tests/support/_mp_workers.py:core_save_killed``: every process saves step 1, then
step 2, and the last process SIGKILLs itself mid-write of step 2. The others wait for
it in the commit; they judge it by its heartbeat (``_base/liveness.py``), so they raise
``CoordinationError`` ("process k is dead") once it was silent ``FOP_PEER_SILENT_S``
(``--silent``, default the package's 10 s), while ``FOP_COORDINATION_TIMEOUT_S`` stays
at its default 300 s (the old rule waited that long) and jax's own heartbeat timeout
at 100 s. The figure: from the victim's death (the wall time it noted just before its
SIGKILL) to the last survivor raising; median and largest over the repeats, with the
1-minute load (``/proc/loadavg``) and the CPU share stolen (``/proc/stat``) beside it.

Heartbeat overhead (2 processes, :func:`heartbeat_cost` in each): the median time of one
beat (``_base/liveness.py``: describe the activities, compare the progress signature,
one key-value set) over 200 beats while an activity with bytes is open, and the share
of one core that is at the default rate (1 beat a second); and the median of
``--saves`` saves of 16 MiB per process with the default heartbeat (1/s) beside the
same saves with a heartbeat 8 times as fast (``FOP_PEER_SILENT_S=0.5``: every 0.125 s),
in one run each, side by side: a difference within noise says the beat costs nothing
a save notices.
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

from _multiprocess import Kill, run_processes  # noqa: E402
from machine_load import cpu_times, load1  # noqa: E402


def one_job(n: int, silent: float) -> tuple[float, float, float]:
    """(seconds from the victim's death to the last survivor raising, load, steal %)."""
    steal0, total0 = cpu_times()
    victim = n - 1
    run = run_processes(
        "_mp_workers:core_save_killed",
        n,
        args={"directory": tempfile.mkdtemp(prefix="fop-live-")},
        kill=Kill(process=victim, at="mid_save"),
        env={"FOP_PEER_SILENT_S": str(silent)},
        heartbeat_timeout_s=100,
        timeout_s=400,
        done_timeout_s=2,
    )
    steal1, total1 = cpu_times()
    died = run[victim].record["t_point_mid_save"]
    raised = []
    for p in run.procs[:victim]:
        res = p.result or {}
        if res.get("save2_type") != "CoordinationError" or "is dead" not in res.get("save2", ""):
            raise AssertionError(f"process {p.process_id}: {res or p.describe()}")
        raised.append(p.record["t_save2_start"] + res["save2_s"])
    steal = 100 * (steal1 - steal0) / max(1, total1 - total0)
    return max(raised) - died, load1(), steal


def heartbeat_cost(ctx, directory, saves):
    """In each process: (median seconds of one beat, median seconds of a save)."""
    # Imported here: this runs in the child processes, after jax.distributed started.
    import time

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop
    from flax_orbax_plugin._base import host, liveness, regions

    beat = liveness._Heartbeat(regions.client(), ctx.process_id + 1000, 1.0)  # a spare key
    with host.ACTIVITIES.doing("writing this process's data", moving=True) as progress:
        progress.total = 1 << 30
        times = []
        for i in range(200):
            progress.done = i << 20
            t = time.perf_counter()
            beat._beat()
            times.append(time.perf_counter() - t)
    rows = 2048 * len(ctx.devices)  # 16 MiB per process
    sharding = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    full = np.ones((rows, 1024), np.float32)
    state = {"w": jax.make_array_from_callback(full.shape, sharding, lambda x: full[x])}
    save_times = []
    with fop.CheckpointManager(directory, async_save=False, keep=1) as mngr:
        for step in range(saves):
            t = time.perf_counter()
            mngr.save(step, state)
            save_times.append(time.perf_counter() - t)
    return {"beat_s": statistics.median(times), "save_s": statistics.median(save_times[1:])}


def overhead(saves: int) -> list[str]:
    """The heartbeat overhead table (see the module docstring)."""
    out = [
        "",
        "| heartbeat | one beat (us), median | core share at that rate "
        "| save of 16 MiB/process (s), median | load 1 min | steal % |",
        "|---|---|---|---|---|---|",
    ]
    for label, silent, rate in (("default, 1/s", "10", 1.0), ("fast, 8/s", "0.5", 8.0)):
        steal0, total0 = cpu_times()
        run = run_processes(
            "bench_liveness:heartbeat_cost",
            2,
            args={"directory": tempfile.mkdtemp(prefix="fop-beat-"), "saves": saves},
            env={"FOP_PEER_SILENT_S": silent, "PYTHONPATH": HERE},
            timeout_s=300,
            done_timeout_s=5,
        )
        steal1, total1 = cpu_times()
        for p in run.procs:
            if not p.ok:
                raise AssertionError(p.describe())
        beat = statistics.median(p.result["beat_s"] for p in run.procs)
        save = max(p.result["save_s"] for p in run.procs)
        steal = 100 * (steal1 - steal0) / max(1, total1 - total0)
        out.append(
            f"| {label} | {beat * 1e6:.0f} | {100 * beat * rate:.3f} % | {save:.3f} "
            f"| {load1():.2f} | {steal:.1f} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--silent", type=float, default=10.0)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--markdown")
    args = parser.parse_args()
    lines = [
        f"FOP_PEER_SILENT_S={args.silent:g}, FOP_COORDINATION_TIMEOUT_S=300 (default), "
        f"{args.repeats} repeats",
        "",
        "| processes | death to last raise (s), median | largest | load 1 min | steal % |",
        "|---|---|---|---|---|",
    ]
    for n in args.processes:
        jobs = [one_job(n, args.silent) for _ in range(args.repeats)]
        times = [j[0] for j in jobs]
        lines.append(
            f"| {n} | {statistics.median(times):.1f} | {max(times):.1f} "
            f"| {statistics.median(j[1] for j in jobs):.2f} "
            f"| {statistics.median(j[2] for j in jobs):.1f} |"
        )
    lines += overhead(args.saves)
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
