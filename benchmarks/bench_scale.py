"""Save and restore throughput with 1, 2 and 4 JAX processes; S3 server vs local disk (issue 6).

    python benchmarks/bench_scale.py [--mib 512] [--repeats 3] [--quick] [--no-s3]
        [--replicated] [--tag NAME]

One global state of ``--mib`` MiB (float32, two leaves sharded by rows over 4 CPU
devices, plus one small replicated leaf) is saved and restored by 1 process with 4
devices, 2 processes with 2 devices and 4 processes with 1 device: the same global
mesh and shards, spread over more processes. Processes are real
``jax.distributed`` processes on 127.0.0.1 (``tests/support/_multiprocess.py``); each builds
only its own shards. Storage: the local disk (``benchmarks/results/tmp``) and a moto
S3 server in its own process on 127.0.0.1 (``tests/support/_s3_server.py``).

Timing (process 0's clock; every process meets at a barrier before and after):
**save** is ``fop.save`` until durable and committed on every process; **restore**
is ``fop.restore`` onto the same shardings until every array is ready, after the
page cache is dropped when running as root (otherwise warm, and the JSON says so).
Also reported per run: the bytes each process wrote and read (``/proc/self/io``).
The raw row is the same bytes written to one file with one fsync and read back.

``--replicated`` replicates every leaf on every device instead (pure data
parallelism): the bytes each process writes then show whether the replicas share the
work (replica-parallel writes: at most ~1/P of the state each) or one process writes
it all.

Results: ``benchmarks/results/scale{-TAG}.{json,md}``. Medians of ``--repeats`` runs.
On this machine (2 CPUs) 4 processes share 2 cores, so the figures show the cost of
coordination and contention more than parallel speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
TMP = os.path.join(RESULTS, "tmp", "scale")
sys.path[:0] = [os.path.join(ROOT, "tests", "support"), HERE]

DEVICES = 4  # global devices in every configuration
COLS = 4096


def _can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


# --------------------------------------------------------------- inside each JAX process


def _like(ctx, rows, replicated=False):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharded = NamedSharding(ctx.mesh, P() if replicated else P("data"))
    return {
        "params": {
            "w": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sharded),
            "b": jax.ShapeDtypeStruct((COLS,), np.float32, sharding=NamedSharding(ctx.mesh, P())),
        },
        "opt_state": {"mu": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sharded)},
    }


def _build(like):
    import jax
    import numpy as np

    def make(sds, seed):
        def cb(idx):
            start = idx[0].start or 0 if idx else 0
            shape = tuple(
                (s.stop if s.stop is not None else n) - (s.start or 0)
                for s, n in zip(idx, sds.shape, strict=True)
            )
            rng = np.random.default_rng([seed, start])
            return rng.random(shape, dtype=np.float32)

        return jax.make_array_from_callback(sds.shape, sds.sharding, cb)

    leaves, treedef = jax.tree.flatten(like)
    return jax.tree.unflatten(treedef, [make(x, i) for i, x in enumerate(leaves)])


def worker(ctx, target, rows, drop, replicated=False, share=False):
    """Runs in every process: one save then one restore, timed between barriers."""
    import jax
    from _multiprocess import read_proc_io

    import flax_orbax_plugin as fop

    client = ctx.client

    def barrier(name):
        if client is not None and ctx.num_processes > 1:
            client.wait_at_barrier(f"bench/{name}", 600_000)

    like = _like(ctx, rows, replicated)
    state = _build(like)
    jax.block_until_ready(state)
    io0 = read_proc_io()
    barrier("save0")
    t0 = time.perf_counter()
    fop.save(target, state)
    barrier("save1")
    save_s = time.perf_counter() - t0
    io1 = read_proc_io()
    del state
    if drop and ctx.process_id == 0:
        _drop_caches()
    barrier("restore0")
    t0 = time.perf_counter()
    kw = {"share_replicated_reads": True} if share else {}
    back = fop.restore(target, like, **kw)
    jax.block_until_ready(back)
    barrier("restore1")
    restore_s = time.perf_counter() - t0
    io2 = read_proc_io()
    return {
        "save_s": save_s,
        "restore_s": restore_s,
        "wrote": io1["wchar"] - io0["wchar"],
        "read": io2["rchar"] - io1["rchar"],
        "write_bytes": io1["write_bytes"] - io0["write_bytes"],
        "read_bytes": io2["read_bytes"] - io1["read_bytes"],
    }


# --------------------------------------------------------------- driver


def _raw(nbytes: int, drop: bool) -> dict:
    import numpy as np

    os.makedirs(TMP, exist_ok=True)
    path = os.path.join(TMP, "raw.bin")
    buf = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    mv = memoryview(buf).cast("B")
    while mv:
        mv = mv[os.write(fd, mv) :]
    os.fsync(fd)
    os.close(fd)
    save_s = time.perf_counter() - t
    del buf
    if drop:
        _drop_caches()
    t = time.perf_counter()
    out = np.empty(nbytes, np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(out)
    restore_s = time.perf_counter() - t
    os.remove(path)
    return {"save_s": save_s, "restore_s": restore_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="state size in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 1 repeat")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--replicated", action="store_true", help="every leaf on every device")
    ap.add_argument("--tag", default="", help="results go to scale-TAG.{json,md}")
    ap.add_argument(
        "--share-reads",
        action="store_true",
        help="restore with share_replicated_reads (each process reads 1/P, all-gather)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.repeats = 64, 1
    from _multiprocess import run_processes
    from _s3_server import S3Server
    from common import machine_description

    rows = max(DEVICES, (args.mib << 20) // (2 * COLS * 4) // DEVICES * DEVICES)
    nbytes = 2 * rows * COLS * 4 + COLS * 4
    drop = _can_drop_caches()
    counts = [int(x) for x in args.processes.split(",")]
    storages = ["local"] + ([] if args.no_s3 else ["s3"])
    started = time.perf_counter()
    samples: list[dict] = []
    s3 = None
    try:
        if "s3" in storages:
            s3 = S3Server(mode="process").start()
            bucket = s3.create_bucket("bench-scale")
        for rep in range(args.repeats):
            for storage in storages:
                for n in counts:
                    name = f"r{rep}-n{n}"
                    if storage == "local":
                        target = os.path.join(TMP, name)
                        shutil.rmtree(target, ignore_errors=True)
                        env = {}
                    else:
                        target = s3.location(bucket, f"scale/{name}").spec
                        env = s3.env
                    run = run_processes(
                        "bench_scale:worker",
                        n,
                        devices_per_process=DEVICES // n,
                        args={
                            "target": target,
                            "rows": rows,
                            "drop": drop,
                            "replicated": args.replicated,
                            "share": args.share_reads,
                        },
                        env={**env, "PYTHONPATH": HERE},
                        timeout_s=900,
                        heartbeat_timeout_s=120,
                    ).check()
                    res = [p.result for p in run.procs]
                    sample = {
                        "storage": storage,
                        "processes": n,
                        "devices_per_process": DEVICES // n,
                        "repeat": rep,
                        "bytes": nbytes,
                        "save_s": res[0]["save_s"],
                        "restore_s": res[0]["restore_s"],
                        "per_process": res,
                    }
                    samples.append(sample)
                    print(
                        f"{storage:5s} n={n} rep={rep}: save {sample['save_s']:.3f}s "
                        f"restore {sample['restore_s']:.3f}s",
                        flush=True,
                    )
                    if storage == "local":
                        shutil.rmtree(target, ignore_errors=True)
            raw = _raw(nbytes, drop)
            samples.append(
                {"storage": "raw", "processes": 1, "repeat": rep, "bytes": nbytes, **raw}
            )
    finally:
        if s3 is not None:
            s3.stop()
    summary = _summarize(samples)
    doc = {
        "title": "flax_orbax_plugin across processes and storage (issue 6)",
        "config": {
            "mib": args.mib,
            "replicated": args.replicated,
            "share_reads": args.share_reads,
            "bytes": nbytes,
            "repeats": args.repeats,
            "global_devices": DEVICES,
            "cold_restore": drop,
            "wall_s": time.perf_counter() - started,
        },
        "machine": machine_description(),
        "summary": summary,
        "samples": samples,
    }
    os.makedirs(RESULTS, exist_ok=True)
    stem = "scale" + (f"-{args.tag}" if args.tag else "")
    with open(os.path.join(RESULTS, f"{stem}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write(_markdown(doc))
    print(_markdown(doc))
    return 0


def _summarize(samples):
    out = []
    keys = sorted(
        {(s["storage"], s["processes"]) for s in samples}, key=lambda k: (k[0] != "raw", k)
    )
    for storage, n in keys:
        group = [s for s in samples if s["storage"] == storage and s["processes"] == n]
        row = {
            "storage": storage,
            "processes": n,
            "n": len(group),
            "bytes": group[0]["bytes"],
            "save_s": statistics.median(s["save_s"] for s in group),
            "restore_s": statistics.median(s["restore_s"] for s in group),
        }
        row["save_mib_s"] = row["bytes"] / 2**20 / row["save_s"]
        row["restore_mib_s"] = row["bytes"] / 2**20 / row["restore_s"]
        if storage == "local":  # socket traffic is not in /proc/self/io's rchar/wchar
            per = [s["per_process"] for s in group]
            row["wrote_mib_per_process"] = [
                statistics.median(p[i]["wrote"] for p in per) / 2**20 for i in range(n)
            ]
            row["read_mib_per_process"] = [
                statistics.median(p[i]["read"] for p in per) / 2**20 for i in range(n)
            ]
        out.append(row)
    return out


def _markdown(doc) -> str:
    c = doc["config"]
    m = doc["machine"]
    lines = [
        f"# {doc['title']}",
        "",
        f"Machine: {m.get('cpu_count')} CPUs ({m.get('cpu_model')}), "
        f"{(m.get('ram_bytes') or 0) / 2**30:.0f} GiB RAM, disk `{m.get('disk')}`; "
        f"plugin {m.get('plugin_commit')}.",
        "",
        f"State: {c['bytes'] / 2**20:.0f} MiB "
        f"{'replicated on' if c.get('replicated') else 'over'} "
        f"{c['global_devices']} CPU devices in every "
        f"row; restores {'cold (page cache dropped)' if c['cold_restore'] else 'WARM (not root)'}; "
        f"medians of {c['repeats']} runs. S3 is a moto server in its own process on 127.0.0.1.",
        "",
        "| storage | processes | save s | save MiB/s | restore s | restore MiB/s | "
        "written MiB per process (local disk) | read MiB per process (local disk) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["summary"]:
        wrote = ", ".join(f"{x:.0f}" for x in r.get("wrote_mib_per_process", [])) or "-"
        read = ", ".join(f"{x:.0f}" for x in r.get("read_mib_per_process", [])) or "-"
        name = "raw (1 file, 1 fsync)" if r["storage"] == "raw" else r["storage"]
        lines.append(
            f"| {name} | {r['processes']} | {r['save_s']:.3f} | {r['save_mib_s']:.0f} | "
            f"{r['restore_s']:.3f} | {r['restore_mib_s']:.0f} | {wrote} | {read} |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
