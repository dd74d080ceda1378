"""A training loop saving straight to an S3 server against saving through a local tier.

    python benchmarks/bench_tiers.py [--mib 64] [--steps 20] [--every 5] [--step-ms 100]
                                     [--reps 3]

Starts moto's S3 server as a child process on 127.0.0.1 (``tests/support/_s3_server.py``),
then runs the same loop in two configurations, alternating them so machine noise hits
both alike, each repetition in a fresh bucket prefix and local directory:

* ``direct``: ``CheckpointManager("s3://...")`` (async saves);
* ``tiered``: ``CheckpointManager(<local tmp>, persistent="s3://...")``: async saves
  to the local disk, each committed step replicated to the bucket in the background;
* ``local``: for reference, the local disk alone (no bucket).

The loop: ``--steps`` steps of ``--step-ms`` of simulated device time (a sleep: the
host is idle, as when an accelerator computes), a save every ``--every`` steps of a
``--mib`` MiB state (float32 params and an optimizer state of the same size).
Reported per configuration (medians over ``--reps``): ``loop``, the training loop
until its last step returns; ``close``, the manager's close (the last local commit,
and for ``tiered`` the replication of the last step: everything in the bucket);
``total``, their sum; and the steps found in the bucket afterwards.
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

import numpy as np  # noqa: E402
from _s3_server import S3Server  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402


def make_state(mib: int, step: int) -> dict:
    n = mib * (1 << 20) // 4 // 2 // 4  # four leaves per item, two items
    rng = np.random.default_rng(step)
    leaves = lambda: {f"l{i}": rng.standard_normal(n, dtype=np.float32) for i in range(4)}
    return {"params": leaves(), "opt_state": leaves()}


def run_loop(mngr, args) -> tuple[float, float]:
    states = [make_state(args.mib, s) for s in range(2)]  # built before timing
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        time.sleep(args.step_ms / 1000)  # the device computes; the host waits
        if step % args.every == 0:
            mngr.save(step, states[step % 2], extras={"loss": 1.0 / step})
    loop = time.perf_counter() - t0
    t1 = time.perf_counter()
    mngr.close()
    return loop, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="also write the raw samples here")
    args = p.parse_args()

    server = S3Server(mode="process").start()
    undo = server.apply_env()
    tmp = tempfile.mkdtemp(prefix="fop-tiers-")
    samples: dict[str, list[dict]] = {"direct": [], "tiered": [], "local": []}
    try:
        bucket = server.create_bucket()
        for rep in range(args.reps):
            order = ("direct", "tiered", "local")
            for kind in order if rep % 2 == 0 else order[::-1]:
                url = f"s3://{bucket}/{kind}-{rep}"
                if kind == "direct":
                    mngr = fop.CheckpointManager(url)
                elif kind == "local":  # reference: the local disk alone, no bucket
                    url = os.path.join(tmp, f"alone-{rep}")
                    mngr = fop.CheckpointManager(url)
                else:
                    local = os.path.join(tmp, f"local-{rep}")
                    mngr = fop.CheckpointManager(local, persistent=url)
                loop, close = run_loop(mngr, args)
                steps = fop.CheckpointManager(url, read_only=True).steps()
                samples[kind].append(
                    {"loop": loop, "close": close, "total": loop + close, "bucket": steps}
                )
                print(f"rep {rep} {kind:6s} loop {loop:.3f} s  close {close:.3f} s  {steps}")
    finally:
        undo()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    saves = args.steps // args.every
    print(
        f"\n{args.mib} MiB state, {args.steps} steps of {args.step_ms:.0f} ms, {saves} saves, "
        f"moto S3 on 127.0.0.1; medians of {args.reps}"
    )
    print(f"{'':8s} {'loop s':>8s} {'close s':>8s} {'total s':>8s}  bucket steps (last rep)")
    for kind, rows in samples.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("loop", "close", "total")}
        print(
            f"{kind:8s} {med['loop']:8.3f} {med['close']:8.3f} {med['total']:8.3f}  "
            f"{rows[-1]['bucket']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
