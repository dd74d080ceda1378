"""Incremental steps: step 2 of a fine-tuning state with a frozen base, with and without
reuse, side by side, on the local disk and on an S3 server.

    python benchmarks/bench_incremental.py [--mib 256] [--frozen 0.9] [--reps 3]
                                           [--store local|s3|both] [--dir DIR]
                                           [--lora] [--peers] [--format-versions 1,2]

The state (``--mib`` MiB of float32 jax.Arrays on the default device): ``params`` = a
frozen base (``--frozen`` of it: 8 equal leaves) plus an adapter (the rest) that changes
every step; LoRA-style with ``--frozen 0.98``. Each repetition, for each mode, in a
fresh directory (local) or bucket prefix (s3): ``CheckpointManager(incremental=mode,
async_save=False)`` saves step 1 (full), then step 2 (the adapter changed); step 2's
save time (blocking + background, durable and committed) and bytes written / reused
are recorded. Prints medians of the repetitions; modes alternate so machine noise hits
both alike. A third line, the floor: a full save of a state holding only what changes.
``--lora``: the issue's state (1200 MiB frozen base, 20 MiB adapter plus its Adam
moments); ``--peers``: orbax-checkpoint and DCP save the same step 2 (in full: neither
has incremental steps), timed until durable, with the bytes they put on disk.
``--format-versions``: the on-disk format versions (FORMAT.md; default 1), each mode of
each version alternated within every repetition (version 2 reuses whole data files).

``--store s3`` starts moto's S3 server as a child process on 127.0.0.1
(``tests/support/_s3_server.py``); incremental steps there copy the unchanged chunk objects on
the server (CopyObject), so "written" is what crossed from this host to the store.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "support"))

import flax_orbax_plugin as fop  # noqa: E402

MiB = 1 << 20


def make_state(total_mib: int, step: int, frozen: float, adam: bool = False) -> dict:
    """``adam``: an ``opt_state`` of Adam moments for the adapter, changing with it."""
    rng = np.random.default_rng(0)
    base_leaf = int(total_mib * frozen / 8 * MiB) // 4 // 1024 * 1024
    adapter = int(total_mib * (1 - frozen) * MiB) // 4 // 1024 * 1024
    base = {
        f"layer_{i}": rng.standard_normal((base_leaf // 1024, 1024), dtype=np.float32)
        for i in range(8)
    }
    shape = (adapter // 1024, 1024)
    state = {
        "params": {
            "base": base,
            "adapter": np.full(shape, float(step), np.float32),
        }
    }
    if adam:
        state["opt_state"] = {
            "mu": np.full(shape, 0.1 * step, np.float32),
            "nu": np.full(shape, 0.01 * step, np.float32),
        }
    return jax.device_put(state)


def one(
    directory: str, incremental: bool | None, states, version: int = 1
) -> tuple[float, int, int]:
    """Step 2's (seconds, bytes written, bytes reused) in a fresh ``directory``."""
    _remove(directory)
    if incremental is None:  # the floor: what changes (adapter, its moments), in full
        states = [_changing(s) for s in states]
    with fop.CheckpointManager(
        directory, incremental=bool(incremental), async_save=False, format_version=version
    ) as m:
        m.save(1, states[0])
        t0 = time.perf_counter()
        m.save(2, states[1])
        seconds = time.perf_counter() - t0
        r = m.last_save
    _remove(directory)
    return seconds, r.bytes_written, r.bytes_reused


def _changing(state: dict) -> dict:
    out = {"params": {"adapter": state["params"]["adapter"]}}
    if "opt_state" in state:
        out["opt_state"] = state["opt_state"]
    return out


def run_peers(root: str, states, reps: int) -> None:
    """Step 2 through orbax-checkpoint and PyTorch DCP (their adapters of
    ``bench_peers``; neither has incremental steps): save step 1, then time step 2's
    save until durable (their save, then an fsync pass over what it wrote, as the
    peers benchmark counts a durable save) and measure the bytes it put on disk."""
    sys.path.insert(0, HERE)
    import common as C
    from peers import get_adapter

    for lib in ("orbax", "dcp"):
        adapter = get_adapter(lib)
        secs, sizes = [], []
        for rep in range(reps):
            first, second = f"{root}/{lib}-{rep}-1", f"{root}/{lib}-{rep}-2"
            adapter.save_async(first, states[0]).wait()
            C.fsync_tree(first)
            t0 = time.perf_counter()
            adapter.save_async(second, states[1]).wait()
            C.fsync_tree(second)
            secs.append(time.perf_counter() - t0)
            sizes.append(C.disk_usage(second)[0])
            C.rmtree(first)
            C.rmtree(second)
        print(
            f"{lib + ' (full)':<14} "
            f"{statistics.median(secs):>8.3f} {statistics.median(sizes) / MiB:>12.1f} "
            f"{0.0:>11.1f}   runs {[round(x, 3) for x in secs]}"
        )


def _remove(directory: str) -> None:
    if "://" in directory:
        from flax_orbax_plugin._storage.location import Location

        Location.from_path(directory).remove()  # moto keeps every object in memory
    else:
        shutil.rmtree(directory, ignore_errors=True)


def run_store(store: str, root: str, states, reps: int, frozen: float, versions=(1,)) -> None:
    total = sum(a.nbytes for a in _leaves(states[0]))
    modes = [(v, mode) for v in versions for mode in (False, True, None)]
    runs: dict = {mode: [] for mode in modes}
    for rep in range(reps):
        for v, mode in modes if rep % 2 == 0 else modes[::-1]:
            runs[(v, mode)].append(one(f"{root}/inc-{v}-{mode}-{rep}", mode, states, v))
    print(f"{store}: state {total / MiB:.0f} MiB ({frozen:.0%} frozen), step 2, medians of {reps}:")
    for v in versions:
        _report(v, {mode: runs[(v, mode)] for mode in (False, True, None)})


def _report(version: int, runs: dict) -> None:
    print(f"format version {version}")
    print(f"{'mode':<14} {'save s':>8} {'MiB written':>12} {'MiB reused':>11}")
    for mode, label in ((False, "full"), (True, "incremental"), (None, "adapter only")):
        secs = statistics.median(r[0] for r in runs[mode])
        wrote = statistics.median(r[1] for r in runs[mode]) / MiB
        reused = statistics.median(r[2] for r in runs[mode]) / MiB
        print(f"{label:<14} {secs:>8.3f} {wrote:>12.1f} {reused:>11.1f}")
    full = statistics.median(r[0] for r in runs[False])
    inc = statistics.median(r[0] for r in runs[True])
    written = statistics.median(r[1] for r in runs[False]) / statistics.median(
        r[1] for r in runs[True]
    )
    print(f"speed-up {full / inc:.1f}x, {written:.1f}x fewer bytes written per step")
    print(f"  all runs (s): full {[round(r[0], 3) for r in runs[False]]}")
    print(f"  incremental {[round(r[0], 3) for r in runs[True]]}")
    print(f"  adapter only {[round(r[0], 3) for r in runs[None]]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--frozen", type=float, default=0.9, help="share of the frozen base")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--store", choices=("local", "s3", "both"), default="local")
    ap.add_argument("--dir", default=None, help="where to write locally (default: a temp dir)")
    ap.add_argument(
        "--lora",
        action="store_true",
        help="the issue's LoRA-style state: a 1200 MiB frozen base, 20 MiB of adapters "
        "and their Adam moments (overrides --mib and --frozen)",
    )
    ap.add_argument(
        "--peers", action="store_true", help="local store: also orbax-checkpoint and DCP"
    )
    ap.add_argument("--format-versions", default="1", help="e.g. 1,2")
    args = ap.parse_args()
    versions = tuple(int(v) for v in args.format_versions.split(","))
    if args.lora:
        args.mib, args.frozen = 1220, 1200 / 1220
    states = [make_state(args.mib, s, args.frozen, adam=args.lora) for s in (1, 2)]
    if args.store in ("local", "both"):
        root = args.dir or tempfile.mkdtemp(prefix="fop-bench-incremental-")
        run_store("local", root, states, args.reps, args.frozen, versions)
        if args.peers:
            run_peers(root, states, args.reps)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.store in ("s3", "both"):
        from _s3_server import S3Server

        server = S3Server(mode="process").start()
        undo = server.apply_env()
        try:
            bucket = server.create_bucket()
            run_store("s3 (moto)", f"s3://{bucket}", states, args.reps, args.frozen, versions)
        finally:
            undo()
            server.stop()


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


if __name__ == "__main__":
    main()
