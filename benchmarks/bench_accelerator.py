"""The plugin on an accelerator (a TPU v5e chip here) beside orbax-checkpoint, one run.

    python benchmarks/bench_accelerator.py --platform tpu --out benchmarks/results
    python benchmarks/bench_accelerator.py --tiny     # CPU, device path on: the script runs

The driver opens no device itself (one program at a time holds a TPU); every part runs
in a fresh process:

1. **loop**: ``train_loop.py`` for each entry (``none``: no saves; ``fop``: a
   ``CheckpointManager``; ``fop-cb``: the ``CheckpointCallback``; ``orbax``), rotated
   rounds: the whole run against the run without saves, the blocking per save, the
   step right after a save against the median step.
2. **io** (``--part io``): a ~3 GB state on the device (float32 params and Adam
   moments): one raw stream of its bytes (``jax.device_get``, one file, one fsync);
   a durable save, a full restore onto the device and a params-only restore, for the
   plugin and orbax, rotated; a tree of 6,000 small leaves saved and restored by both;
   and the correctness check: saves taken while a donating step keeps overwriting the
   state (``fop.save_async`` and a manager) restored onto the device bit for bit.

Writes ``accelerator.json`` and ``accelerator.md`` to ``--out``; exits non-zero when a
check failed. ``--tiny``: a few MiB on CPU with the plugin's device path switched on
(``CPU_AS_DEVICE``); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _med(xs):
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------- io part


def _io(a) -> dict:
    import common as C
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flax_orbax_plugin as fop

    if a.tiny:
        from flax_orbax_plugin._core import device_copy

        device_copy.CPU_AS_DEVICE = True
    dev = jax.devices()[0]
    res: dict = {"platform": dev.platform, "device": getattr(dev, "device_kind", str(dev))}
    res["errors"] = []
    side, n = (256, 4) if a.tiny else (4096, 16)  # 16 x 64 MiB per part: ~3 GB in all
    key = jax.random.key(0)

    def part(seed):
        return {
            f"w{i}": jax.random.normal(jax.random.fold_in(key, seed * 100 + i), (side, side))
            for i in range(n)
        }

    tree = {"params": part(1), "opt_state": {"mu": part(2), "nu": part(3)}}
    tree["params"]["bias"] = jnp.zeros((side,))
    jax.block_until_ready(tree)
    leaves = jax.tree_util.tree_leaves(tree)
    res["state_bytes"] = sum(x.nbytes for x in leaves)
    like = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    root = os.path.join(a.dir, "io")
    C.rmtree(root)
    os.makedirs(root)

    # the raw stream: one device-to-host copy, one file, one fsync
    raw = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        host = jax.device_get(leaves)
        C.raw_write(os.path.join(root, "raw.bin"), host)
        raw.append(time.perf_counter() - t0)
        del host
        os.remove(os.path.join(root, "raw.bin"))
    res["raw_stream_s"] = _med(raw)

    from peers import get_adapter

    libs = {"fop": get_adapter("fop")}
    try:
        libs["orbax"] = get_adapter("orbax")
    except Exception as e:  # noqa: BLE001  (orbax not installed: the plugin alone)
        res["errors"].append(f"orbax: {type(e).__name__}: {e}"[:300])
    samples = {
        lib: {"blocking_s": [], "save_s": [], "restore_s": [], "params_s": []} for lib in libs
    }
    for rep in range(a.repeats):
        names = list(libs)
        for lib in names[rep % len(names) :] + names[: rep % len(names)]:
            ad, path = libs[lib], os.path.join(root, f"{lib}_{rep}")
            try:
                t0 = time.perf_counter()
                w = ad.save_async(path, tree)
                samples[lib]["blocking_s"].append(time.perf_counter() - t0)
                w.wait()
                C.fsync_tree(path)  # one fsync pass for both, counted
                samples[lib]["save_s"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = jax.block_until_ready(ad.restore(path, like))
                samples[lib]["restore_s"].append(time.perf_counter() - t0)
                if rep == 0:
                    res[f"{lib}_restored_bit_for_bit"] = all(
                        bool(jnp.array_equal(x, y)) and x.sharding == y.sharding
                        for x, y in zip(jax.tree_util.tree_leaves(out), leaves, strict=True)
                    )
                del out
                t0 = time.perf_counter()
                p = jax.block_until_ready(ad.restore_params(path, like["params"]))
                samples[lib]["params_s"].append(time.perf_counter() - t0)
                del p
                C.rmtree(path)
            except Exception as e:  # noqa: BLE001  (reported, the others go on)
                res["errors"].append(f"{lib} io rep {rep}: {type(e).__name__}: {e}"[:500])
    for lib, d in samples.items():
        for k, xs in d.items():
            res[f"{lib}_{k}"] = _med(xs)
    if res.get("fop_save_s") and res.get("raw_stream_s"):
        res["fop_save_over_raw"] = res["fop_save_s"] / res["raw_stream_s"]

    # 6,000 small leaves
    small = {
        f"l{i}": jnp.full((8 + i % 32,), float(i), jnp.float32)
        for i in range(600 if a.tiny else 6000)
    }
    jax.block_until_ready(small)
    small_like = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), small
    )
    for lib, ad in libs.items():
        path = os.path.join(root, f"small_{lib}")
        try:
            t0 = time.perf_counter()
            w = ad.save_async(path, small)
            res[f"{lib}_small_blocking_s"] = time.perf_counter() - t0
            w.wait()
            res[f"{lib}_small_save_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            jax.block_until_ready(ad.restore(path, small_like))
            res[f"{lib}_small_restore_s"] = time.perf_counter() - t0
            C.rmtree(path)
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"{lib} small: {type(e).__name__}: {e}"[:500])

    # correctness: saves under a donating step, restored onto the device bit for bit
    step = jax.jit(lambda t: jax.tree_util.tree_map(lambda x: x * 0.5 + 1.0, t), donate_argnums=0)
    state = jax.tree_util.tree_map(jnp.copy, tree)
    del tree, leaves
    checks = []
    with fop.CheckpointManager(os.path.join(root, "run"), keep=2) as mngr:
        for k in range(3):
            expected = jax.device_get(state)
            handle = fop.save_async(os.path.join(root, f"donated_{k}"), state)
            mngr.save(k + 1, state)
            for _ in range(3):  # the loop goes on at once, donating the saved buffers
                state = step(state)
            handle.wait()
            mngr.wait()
            for path in (os.path.join(root, f"donated_{k}"),):
                got = fop.restore(path, like)
                checks.append(
                    all(
                        np.array_equal(np.asarray(x), y)
                        for x, y in zip(
                            jax.tree_util.tree_leaves(got),
                            jax.tree_util.tree_leaves(expected),
                            strict=True,
                        )
                    )
                )
                C.rmtree(path)
            got = mngr.restore(step=k + 1, like=like)
            checks.append(
                all(
                    np.array_equal(np.asarray(x), y) and x.sharding == s.sharding
                    for x, y, s in zip(
                        jax.tree_util.tree_leaves(got),
                        jax.tree_util.tree_leaves(expected),
                        jax.tree_util.tree_leaves(like),
                        strict=True,
                    )
                )
            )
            del got, expected
    res["donated_saves_bit_for_bit"] = checks
    C.rmtree(root)
    return res


# ----------------------------------------------------------------------------- driver


def _loop(a) -> dict:
    import bench_train

    entries = [e for e in a.libs.split(",") if e]
    args = argparse.Namespace(
        dir=os.path.join(a.dir, "loop"),
        steps=a.steps,
        every=a.every,
        keep=2,
        batch=a.batch,
        platform=a.platform,
        cpu_as_device=a.tiny,
    )
    runs, loads = bench_train.run_rotated(entries, a.rounds, args)
    rows = bench_train.summarize(entries, runs)
    for r in rows:
        if r.get("after_save_median_s") and r.get("step_median_s"):
            r["after_over_step"] = r["after_save_median_s"] / r["step_median_s"]
    return {"rows": rows, "runs": runs, "loads": loads}


def _markdown(loop: dict, io: dict, a) -> str:
    out = [f"# On the accelerator: {io.get('device', a.platform)} ({io.get('platform')})", ""]
    out += [
        f"Training loop: {a.steps} steps, a save at every {a.every}-th (the first included), "
        f"keep 2; {a.rounds} rotated rounds, each entry a fresh process; medians.",
        "",
        "| entry | loop / no saves | blocking per save s | step after a save / median "
        "step | step median s |",
        "|---|---|---|---|---|",
    ]
    for r in loop.get("rows", []):
        if "total_median_s" not in r:
            out.append(f"| {r['entry']} | error | | | |")
            continue
        ratio = f"{r['ratio']:.3f}x" if "ratio" in r else "-"
        blk = f"{r['blocking_median_s']:.4f}" if "blocking_median_s" in r else "-"
        aft = f"{r['after_over_step']:.2f}x" if "after_over_step" in r else "-"
        out.append(f"| {r['entry']} | {ratio} | {blk} | {aft} | {r['step_median_s']:.4f} |")
    gb = io.get("state_bytes", 0) / 1e9
    out += ["", f"State of {gb:.2f} GB on the device; medians of {a.repeats}.", ""]
    out += ["| figure | fop | orbax |", "|---|---|---|"]

    def row(name, key):
        f, o = io.get(f"fop_{key}"), io.get(f"orbax_{key}")
        out.append(f"| {name} | {f'{f:.3f}' if f else '-'} | {f'{o:.3f}' if o else '-'} |")

    row("async save: blocking s", "blocking_s")
    row("durable save s", "save_s")
    row("restore onto the device s", "restore_s")
    row("params-only restore s", "params_s")
    row("6,000 leaves: blocking s", "small_blocking_s")
    row("6,000 leaves: save s", "small_save_s")
    row("6,000 leaves: restore s", "small_restore_s")
    raw = io.get("raw_stream_s")
    out += [
        "",
        f"Raw stream (device_get, one file, fsync): {raw:.3f} s; the plugin's durable save "
        f"{io.get('fop_save_over_raw', 0):.2f}x it."
        if raw
        else "",
        f"Saves under a donating step restored bit for bit: {io.get('donated_saves_bit_for_bit')}.",
        f"Errors: {io.get('errors')}",
    ]
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["all", "io", "loop"], default="all")
    p.add_argument("--platform", default="tpu")
    p.add_argument("--libs", default="none,fop,fop-cb,orbax")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--every", type=int, default=30)
    p.add_argument("--batch", type=int, default=12, help="rows of the loop step's input")
    p.add_argument("--dir", default="/tmp/fop_accel")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--tiny", action="store_true")
    a = p.parse_args(argv)
    if a.tiny:
        a.platform = "cpu"
        os.environ["FOP_BENCH_SIZE"] = "tiny"
        a.steps, a.every, a.rounds, a.repeats = min(a.steps, 6), min(a.every, 3), 1, 1
    if a.part == "io":
        print("IO " + json.dumps(_io(a), default=str), flush=True)
        return 0
    loop = _loop(a) if a.part in ("all", "loop") else {}
    io: dict = {}
    if a.part == "all":
        args = [sys.executable, os.path.abspath(__file__), "--part", "io", "--dir", a.dir]
        args += ["--repeats", str(a.repeats), "--platform", a.platform] + (
            ["--tiny"] if a.tiny else []
        )
        env = dict(os.environ, JAX_PLATFORMS=a.platform, PYTHONUNBUFFERED="1")
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=1800)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("IO ")]
        io = json.loads(lines[-1][3:]) if lines else {"errors": [proc.stderr[-3000:]]}
    md = _markdown(loop, io, a)
    os.makedirs(a.out, exist_ok=True)
    name = "accelerator-tiny" if a.tiny else "accelerator"
    with open(os.path.join(a.out, name + ".json"), "w") as f:
        json.dump({"args": vars(a), "loop": loop, "io": io}, f, indent=1, default=str)
    with open(os.path.join(a.out, name + ".md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    failed = [r["entry"] for r in loop.get("rows", []) if "total_median_s" not in r]
    checks = io.get("donated_saves_bit_for_bit") or []
    unchecked = a.part != "loop" and not (checks and all(checks))  # the io part ran
    bad = failed or unchecked or io.get("errors")
    if bad:
        print(f"FAILED: loop {failed}, checks {checks}, errors {io.get('errors')}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
