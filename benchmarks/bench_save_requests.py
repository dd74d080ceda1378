"""S3 requests and blocking time of one manager save against the number of steps kept.

    python benchmarks/bench_save_requests.py [--kept 2 60 200] [--processes 1]

A tiny state (two float32 leaves, 4 KiB) is saved by ``CheckpointManager`` with
``keep=None`` into a moto S3 server running in this process (``tests/support/_s3_server.py``,
thread mode); the requests the server answers are counted by kind with
``tests/support/_s3_requests.py``. For each figure in ``--kept``, saves go on until that many
steps are kept; the next 5 saves are measured: requests per save (LIST, GET, HEAD,
PUT, DELETE, from ``save`` until ``wait`` returns) and the blocking ``save`` time
(median). ``--processes N`` (N > 1) runs the same in N ``jax.distributed`` processes
(``tests/support/_multiprocess.py``); the counts are then of all processes together.

Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "tests", "support"), ROOT]


def _meet() -> None:
    """Every process meets here: a barrier outside any operation (a region spanning none)."""
    from flax_orbax_plugin._base import distributed as _distributed

    outside = _distributed.Region("bench")
    outside.barrier(outside.next_operation_id("bench"))


def saves(ctx, url, kept, measured=5, counter=None):
    """Saves until ``kept`` steps are kept, then measures ``measured`` more saves.
    Runs in every process (``ctx`` None: one process, no jax.distributed)."""
    import jax
    import numpy as np

    import flax_orbax_plugin as fop

    state = {"params": {"w": np.arange(512, dtype=np.float32), "b": np.ones(512, np.float32)}}
    mngr = fop.CheckpointManager(url, keep=None)
    out = []
    step = 0
    for _ in range(kept):
        step += 1
        mngr.save(step, state)
    mngr.wait()
    for _ in range(measured):
        step += 1
        _meet()
        if counter is not None:
            counter.take()
        t = time.perf_counter()
        mngr.save(step, state)
        blocking = time.perf_counter() - t
        mngr.wait()
        _meet()
        out.append(
            {"blocking_s": blocking, "requests": None if counter is None else counter.take()}
        )
    mngr.close()
    del jax
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kept", type=int, nargs="+", default=[2, 60, 200])
    ap.add_argument("--processes", type=int, default=1)
    args = ap.parse_args()
    from _s3_requests import S3Requests
    from _s3_server import S3Server

    server = S3Server(mode="thread").start()
    server.apply_env()
    with S3Requests() as counter:
        for kept in args.kept:
            bucket = server.create_bucket()
            url = server.location(bucket, "ckpt").url
            if args.processes == 1:
                rows = saves(None, url, kept, counter=counter)
            else:
                rows = _multi(url, kept, args.processes, counter)
            reqs = [r["requests"] for r in rows]
            kinds = sorted({k for r in reqs for k in r})
            print(
                json.dumps(
                    {
                        "processes": args.processes,
                        "kept": kept,
                        "blocking_ms_median": round(
                            1000 * statistics.median(r["blocking_s"] for r in rows), 2
                        ),
                        "requests_per_save": {
                            k: statistics.median(r.get(k, 0) for r in reqs) for k in kinds
                        },
                    }
                ),
                flush=True,
            )
    server.stop()


def _multi(url, kept, n, counter):
    """N processes save; the parent's counter sees the requests of all of them. The
    primary marks each measured save's start and end with a file and waits for the
    parent's answer file, so the parent takes the counts between the marks."""
    import tempfile
    import threading

    from _multiprocess import run_processes

    workdir = tempfile.mkdtemp(prefix="fop-bench-req-")
    counts: list[dict] = []
    done = threading.Event()

    def follow() -> None:
        i = 0
        while not done.is_set():
            for edge in ("start", "end"):
                mark = os.path.join(workdir, f"mark_{i}_{edge}")
                while not os.path.exists(mark) and not done.is_set():
                    time.sleep(0.002)
                if done.is_set():
                    return
                taken = counter.take()
                if edge == "end":
                    counts.append(taken)
                open(os.path.join(workdir, f"ack_{i}_{edge}"), "w").close()
            i += 1

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        run = run_processes(
            "bench_save_requests:saves_multi",
            n,
            devices_per_process=1,
            args={"url": url, "kept": kept},
            env={"PYTHONPATH": HERE},
            workdir=workdir,
            timeout_s=900,
        ).check()
    finally:
        done.set()
        thread.join()
    return [
        {"blocking_s": r["blocking_s"], "requests": c}
        for r, c in zip(run[0].result, counts, strict=True)
    ]


def saves_multi(ctx, url, kept, measured=5):
    """In each process: ``kept`` saves, then ``measured`` saves between marks (above)."""
    import numpy as np

    import flax_orbax_plugin as fop

    def mark(i: int, edge: str) -> None:
        if ctx.process_id == 0:
            open(os.path.join(ctx.workdir, f"mark_{i}_{edge}"), "w").close()
            while not os.path.exists(os.path.join(ctx.workdir, f"ack_{i}_{edge}")):
                time.sleep(0.002)
        _meet()

    state = {"params": {"w": np.arange(512, dtype=np.float32), "b": np.ones(512, np.float32)}}
    mngr = fop.CheckpointManager(url, keep=None)
    for step in range(1, kept + 1):
        mngr.save(step, state)
    mngr.wait()
    out = []
    for i in range(measured):
        step = kept + 1 + i
        mark(i, "start")
        t = time.perf_counter()
        mngr.save(step, state)
        blocking = time.perf_counter() - t
        mngr.wait()
        mark(i, "end")
        out.append({"blocking_s": blocking})
    mngr.close()
    return out


if __name__ == "__main__":
    main()
