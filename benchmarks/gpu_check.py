"""Workload (a) with the state on one NVIDIA GPU: this plugin against orbax-checkpoint.

Run by ``benchmarks/gpu_check.sh`` on the device machine (see its header). One
process; for each library, interleaved, ``--repeats`` times: an async save of the
~1.2 GB training state living on the GPU (blocking = until save_async returns, i.e.
the device-to-host copy; total = until durable, then one fsync pass over the
checkpoint for every library alike, counted, as in bench_peers.py), then a restore
onto the GPU (each result's leaf types and shardings checked on every repeat) after
dropping the page cache (when the kernel lets us; recorded). Also the references: one
device-to-host copy of the tree (jax.device_get) and the raw write/read of its bytes.
Prints one ``GPU_CHECK {json}`` line and writes the same JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/fop_gpu_check")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--libs", default="fop,orbax")
    a = p.parse_args(argv)
    t_start = time.perf_counter()

    import common as C
    import jax
    import numpy as np
    from peers import get_adapter

    res: dict = {"check": "gpu workload (a)", "repeats": a.repeats, "errors": []}
    gpu = jax.devices()[0]
    res["device"] = str(gpu.device_kind if hasattr(gpu, "device_kind") else gpu)
    res["platform"] = gpu.platform
    res["versions"] = C.machine_description()["versions"]
    res["cpu_count"] = os.cpu_count()
    if gpu.platform != "gpu":
        res["errors"].append(f"jax default device is {gpu.platform}, not a GPU")

    specs = C.tree_specs("a")
    from jax.sharding import SingleDeviceSharding

    sh = SingleDeviceSharding(gpu)
    tree = C.nest((s.path, jax.device_put(s.make(), sh)) for s in specs)
    jax.block_until_ready(tree)
    like = C.nest(
        (s.path, jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=sh)) for s in specs
    )
    res["tree_bytes"] = C.total_bytes(specs)
    res["setup_s"] = time.perf_counter() - t_start

    def drop():
        try:
            C.drop_caches()
            return True
        except OSError:
            os.sync()
            return False

    # References: one device-to-host copy of the tree; raw write and cold read.
    leaves = jax.tree_util.tree_leaves(tree)
    d2h = []
    raw_w, raw_r = [], []
    os.makedirs(a.dir, exist_ok=True)
    rawp = os.path.join(a.dir, "raw.bin")
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        host = jax.device_get(leaves)
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        C.raw_write(rawp, host)
        raw_w.append(time.perf_counter() - t0)
        del host
        res["cold_reads"] = drop()
        t0 = time.perf_counter()
        buf = C.raw_read(rawp)
        raw_r.append(time.perf_counter() - t0)
        del buf
    C.rmtree(rawp)
    res["d2h_copy_s"] = statistics.median(d2h)
    res["raw_write_s"] = statistics.median(raw_w)
    res["raw_read_s"] = statistics.median(raw_r)

    libs = [x for x in a.libs.split(",") if x]
    adapters = {}
    for lib in libs:
        try:
            ad = get_adapter(lib)
            # warm-up: a tiny save/restore on the GPU
            wp = os.path.join(a.dir, f"warm_{lib}")
            C.rmtree(wp)
            small = {"params": {"w": jax.device_put(np.ones((4, 4), np.float32), sh)}}
            ad.save_async(wp, small).wait()
            jax.block_until_ready(
                ad.restore(
                    wp,
                    jax.tree_util.tree_map(
                        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), small
                    ),
                )
            )
            C.rmtree(wp)
            adapters[lib] = ad
        except Exception as e:  # noqa: BLE001  (report, go on with the others)
            res["errors"].append(f"{lib} setup: {type(e).__name__}: {e}"[:500])

    samples = {lib: {"blocking_s": [], "save_s": [], "restore_s": []} for lib in adapters}
    for rep in range(a.repeats):
        names = list(adapters)
        k = rep % max(len(names), 1)
        for lib in names[k:] + names[:k]:
            ad = adapters[lib]
            path = os.path.join(a.dir, lib)
            try:
                C.rmtree(path)
                os.sync()
                t0 = time.perf_counter()
                w = ad.save_async(path, tree)
                t1 = time.perf_counter()
                w.wait()
                C.fsync_tree(path)  # one fsync pass for every library alike, counted
                t2 = time.perf_counter()
                samples[lib]["blocking_s"].append(t1 - t0)
                samples[lib]["save_s"].append(t2 - t0)
                drop()
                t0 = time.perf_counter()
                out = ad.restore(path, like)
                jax.block_until_ready(out)
                samples[lib]["restore_s"].append(time.perf_counter() - t0)
                # every repeat: each leaf a jax.Array of the saved shape, dtype, sharding
                placed = all(
                    isinstance(x, jax.Array)
                    and x.shape == y.shape
                    and x.dtype == y.dtype
                    and x.sharding == y.sharding
                    for x, y in zip(jax.tree_util.tree_leaves(out), leaves, strict=True)
                )
                res.setdefault(f"{lib}_checks_passed", []).append(placed)
                if rep == 0:
                    ok = all(
                        bool(jax.numpy.array_equal(x, y)) and x.sharding == y.sharding
                        for x, y in zip(jax.tree_util.tree_leaves(out), leaves, strict=True)
                    )
                    res[f"{lib}_verified"] = ok
                del out
                C.rmtree(path)
            except Exception as e:  # noqa: BLE001  (reported in the results)
                res["errors"].append(f"{lib} rep {rep}: {type(e).__name__}: {e}"[:500])
    for lib, d in samples.items():
        for k, xs in d.items():
            res[f"{lib}_{k}"] = statistics.median(xs) if xs else None
    for k in ("blocking_s", "save_s", "restore_s"):
        fo, ob = res.get(f"fop_{k}"), res.get(f"orbax_{k}")
        res[f"orbax_over_fop_{k}"] = ob / fo if fo and ob else None
    res["fop_blocking_over_d2h"] = (
        res["fop_blocking_s"] / res["d2h_copy_s"] if res.get("fop_blocking_s") else None
    )
    res["wall_s"] = time.perf_counter() - t_start
    C.rmtree(a.dir)
    line = json.dumps(res, default=str)
    print("GPU_CHECK " + line, flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_check.json"), "w") as fh:
        fh.write(line + "\n")


if __name__ == "__main__":
    main()
