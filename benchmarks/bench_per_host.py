"""Each host its own local directory: restore by way (a), (b), (c), and a training loop
saving locally every 5 steps and to the bucket every 50, against straight to the bucket.

    python benchmarks/bench_per_host.py [--mib 64] [--repeats 3] [--steps 100]
                                        [--every 5] [--persistent-every 50]
                                        [--step-ms 50] [--tiny] [--json PATH]

Starts moto's S3 server as a child process on 127.0.0.1 (``tests/support/_s3_server.py``)
and one job of 2 real JAX processes (``tests/support/_multiprocess.py``, 2 CPU devices
each, gloo collectives), each on its own directory (``<tmp>/host<i>``). The state
(``--mib`` MiB of float32, 8 leaves) is sharded over each host's devices and replicated
across the hosts (mesh ``(replica=2, data=2)``): each host holds all of it, so a host
that lost its directory can get it from its peer.

Restore (each repeat, after one save of step 50 committed on both hosts and in the
bucket; the time of the slowest process: manager open + restore + block_until_ready):

* ``a``: every host holds the step: each reads its own files;
* ``b``: host 1's directory wiped: host 0 reads its copy and sends it over jax
  collectives, host 1 checks, commits, then both read their own files;
* ``c``: both directories wiped: each host copies the step down from the bucket, then
  reads it.

Each restore's way is taken from the manager's log and checked. Reported per way and
process: bytes read from the bucket (tensorstore's S3 metrics), bytes read from disk
(``/proc/self/io`` ``read_bytes``: page-cache hits are not counted) and bytes read by
read calls (``rchar``: own files, cached or not), and for (b) the bytes that crossed
the collectives (the step's files host 1 received).

Training loop (``--steps`` steps of ``--step-ms`` of simulated device time, a sleep;
a save every ``--every`` steps; async saves; the two configurations alternate):

* ``per_host``: ``CheckpointManager(<own dir>, persistent=Tier("s3://...",
  every=50), keep=2)``;
* ``bucket``: ``CheckpointManager("s3://...")``, every save to the bucket.

``loop``: until the last step returns; ``close``: the manager's close (the last commit
and, per_host, the last due step in the bucket). Medians of ``--repeats``.
``--tiny``: a 4 MiB state, 20 steps, persistent_every 10, one repeat (a smoke run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
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
from _multiprocess import run_processes  # noqa: E402
from _s3_server import S3Server  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402

WAYS = ("a", "b", "c")
RESTORED = 50  # the step every restore reads
_ROUND = itertools.count()  # the names of the barriers, alike on every process


class _Ways(logging.Handler):
    """The restore ways the manager logged."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.ways: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        self.ways += [w for w in WAYS if f"(way {w})" in text]


def _mesh(ctx):
    from jax.sharding import Mesh

    devices = sorted(ctx.devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices).reshape(ctx.num_processes, -1), ("replica", "data"))


def make_state(ctx, mib: float, step: int) -> dict:
    """8 float32 leaves of ``mib`` MiB in all, sharded over each host's devices
    (``data``) and replicated across hosts (``replica``)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(_mesh(ctx), P("data"))
    rows = max(2, int(mib * (1 << 20) / 4 / 8 / 1024) // 2 * 2)
    rng = np.random.default_rng(step)

    def leaf():
        host = rng.standard_normal((rows, 1024), dtype=np.float32)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    return {
        "params": {f"w{i}": leaf() for i in range(4)},
        "opt_state": {f"m{i}": leaf() for i in range(4)},
    }


def _bucket_bytes(kind: str = "read") -> int:
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/s3/bytes_{kind}")
    return sum(v.get("value", 0) for m in found for v in m["values"])


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _step_bytes(directory: str, step: int) -> int:
    root = os.path.join(directory, str(step))
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(root)
        for f in fs
        if f != "_HOST.json"
    )


def _wipe(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _restore_once(ctx, local, url, like, way) -> dict:
    """Wipes as ``way`` asks, then times open + restore on every process."""
    import jax

    n = next(_ROUND)
    ctx.client.wait_at_barrier(f"wipe-{way}-{n}", 60_000)
    if way == "c" or (way == "b" and ctx.process_id == 1):
        _wipe(local)
    ctx.client.wait_at_barrier(f"go-{way}-{n}", 60_000)
    ways = _Ways()
    logger = logging.getLogger("flax_orbax_plugin")
    logger.addHandler(ways)
    try:
        io0, bucket0, t0 = _io(), _bucket_bytes(), time.perf_counter()
        with fop.CheckpointManager(local, persistent=url) as mngr:
            got = mngr.restore(like=like)
            jax.block_until_ready(got)
            seconds = time.perf_counter() - t0
            io1, bucket1 = _io(), _bucket_bytes()
            step = mngr.restored_step
    finally:
        logger.removeHandler(ways)
    if ways.ways != [way] or step != RESTORED:
        raise AssertionError(f"expected way {way} of step {RESTORED}, logged {ways.ways} {step}")
    return {
        "seconds": seconds,
        "bucket_read": bucket1 - bucket0,
        "disk_read": io1["read_bytes"] - io0["read_bytes"],
        "rchar": io1["rchar"] - io0["rchar"],
        "step_bytes": _step_bytes(local, RESTORED),
    }


def _loop(ctx, mngr, states, args) -> dict:
    ctx.client.wait_at_barrier(f"loop-{next(_ROUND)}", 60_000)
    t0 = time.perf_counter()
    for step in range(1, args["steps"] + 1):
        time.sleep(args["step_ms"] / 1000)  # the device computes; the host waits
        if step % args["every"] == 0:
            mngr.save(step, states[step % 2], extras={"loss": 1.0 / step})
    loop = time.perf_counter() - t0
    t1 = time.perf_counter()
    mngr.close()
    return {"loop": loop, "close": time.perf_counter() - t1}


def worker(ctx, base, bucket_url, args) -> dict:
    """Runs in each of the 2 processes: the restores, then the loops."""
    logging.getLogger("flax_orbax_plugin").setLevel(logging.INFO)
    local = os.path.join(base, f"host{ctx.process_id}")
    url = f"{bucket_url}/restore"
    with fop.CheckpointManager(local, persistent=url) as mngr:
        mngr.save(RESTORED, make_state(ctx, args["mib"], RESTORED))
        mngr.wait()
        assert mngr.persistent.wait(300)
    like = make_state(ctx, args["mib"], 0)
    out: dict = {w: [] for w in WAYS}
    for _ in range(args["repeats"]):
        for way in WAYS:
            out[way].append(_restore_once(ctx, local, url, like, way))
    del like
    states = [make_state(ctx, args["mib"], s) for s in range(2)]
    out["per_host"], out["bucket"] = [], []
    for rep in range(args["repeats"]):
        for kind in ("per_host", "bucket") if rep % 2 == 0 else ("bucket", "per_host"):
            where = f"{bucket_url}/{kind}-{rep}"
            written0 = _bucket_bytes("written")
            if kind == "bucket":
                mngr = fop.CheckpointManager(where)
            else:
                own = os.path.join(base, f"loop{rep}-host{ctx.process_id}")
                tier = fop.Tier(where, every=args["persistent_every"])
                mngr = fop.CheckpointManager(own, keep=2, persistent=tier)
            row = _loop(ctx, mngr, states, args)
            row["bucket_written"] = _bucket_bytes("written") - written0
            row["bucket_steps"] = fop.CheckpointManager(where, read_only=True).steps()
            out[kind].append(row)
    return out


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(results: list[dict], args: dict) -> str:
    """The tables: per way, the slowest process's time; bytes per process."""
    r0, r1 = results
    mib = 1 << 20
    lines = [
        f"{args['mib']} MiB state per host (replicated across the 2 hosts), moto S3 on "
        f"127.0.0.1, 2 processes x 2 CPU devices; medians of {args['repeats']}; "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "",
        "| way | restore s (slowest process) | from the bucket MiB (p0 / p1) | disk read_bytes "
        "MiB (p0 / p1) | read calls rchar MiB (p0 / p1) | over collectives MiB |",
        "|---|---|---|---|---|---|",
    ]
    for way in WAYS:
        pairs = zip(r0[way], r1[way], strict=True)
        t = statistics.median(max(a["seconds"], b["seconds"]) for a, b in pairs)
        cols = [
            " / ".join(f"{_median(r[way], k) / mib:.1f}" for r in (r0, r1))
            for k in ("bucket_read", "disk_read", "rchar")
        ]
        peer = f"{_median(r1[way], 'step_bytes') / mib:.1f}" if way == "b" else "0"
        lines.append(f"| ({way}) | {t:.3f} | {cols[0]} | {cols[1]} | {cols[2]} | {peer} |")
    saves = args["steps"] // args["every"]
    lines += [
        "",
        f"Training loop: {args['steps']} steps of {args['step_ms']:.0f} ms, a save every "
        f"{args['every']} ({saves} saves); per_host: persistent_every="
        f"{args['persistent_every']}. Slowest process; medians of {args['repeats']}.",
        "",
        "| | loop s | close s | total s | to the bucket MiB (both processes) | bucket steps |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("per_host", "bucket"):
        pairs = list(zip(r0[kind], r1[kind], strict=True))
        loop = statistics.median(max(a["loop"], b["loop"]) for a, b in pairs)
        close = statistics.median(max(a["close"], b["close"]) for a, b in pairs)
        total = statistics.median(
            max(a["loop"] + a["close"], b["loop"] + b["close"]) for a, b in pairs
        )
        written = statistics.median(a["bucket_written"] + b["bucket_written"] for a, b in pairs)
        steps = r0[kind][-1]["bucket_steps"]
        lines.append(
            f"| {kind} | {loop:.3f} | {close:.3f} | {total:.3f} | {written / mib:.1f} | "
            f"{steps if len(steps) <= 4 else f'{len(steps)} steps'} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--persistent-every", type=int, default=50)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--tiny", action="store_true", help="4 MiB, 20 steps, one repeat")
    p.add_argument("--json", help="also write the raw samples here")
    args = vars(p.parse_args())
    if args.pop("tiny"):
        args.update(mib=4, steps=20, persistent_every=10, repeats=1)
    json_path = args.pop("json")
    server = S3Server(mode="process").start()
    undo = server.apply_env()  # the children inherit the server's credentials
    tmp = tempfile.mkdtemp(prefix="fop-per-host-")
    t0 = time.perf_counter()
    try:
        url = f"s3://{server.create_bucket()}"
        run = run_processes(
            "bench_per_host:worker",
            2,
            devices_per_process=2,
            args={"base": tmp, "bucket_url": url, "args": args},
            env={"PYTHONPATH": HERE, "FOP_COORDINATION_TIMEOUT_S": "120"},
            timeout_s=1200,
        ).check()
    finally:
        undo()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(run.results, args))
    print(f"\n(whole run {time.perf_counter() - t0:.0f} s)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"args": args, "samples": run.results}, f, indent=1)


if __name__ == "__main__":
    main()
