"""Issue 5's benchmark: this plugin against orbax-checkpoint, PyTorch DCP, Flax msgpack
and the raw limit of the disk, in one run, on the same trees.

    benchmarks/run.sh peers           # or: python benchmarks/bench_peers.py [--quick]

Workloads: (a) ~1.2 GB training state, (b) ~6,000 small arrays (~200 MB), (c) (a)
sharded over 8 CPU devices on a 2x4 mesh, restored onto 4x2 and onto one device.
Then a training loop with background saves every few steps, per library. Each
figure is the median of ``--repeats`` runs (interleaved across libraries), each
operation in a fresh process. Writes benchmarks/results/peers.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C
import harness as H
from peers import LIBRARIES

NOTES = [
    "Before every save (every library and the raw rows alike) the harness writes and "
    "deletes a file of twice the tree's bytes: on this VM, memory the guest never "
    "touched costs about 10x the system time to write into, which otherwise fell on "
    "whichever row wrote first (the raw rows of the previous run: 1.89 s for a save "
    "measured at 0.76 s the run before).",
    "Every library saves the same jax.Array tree (float32 random values, fixed seeds) and "
    "restores onto the same jax.ShapeDtypeStruct targets; DCP and msgpack convert to/from "
    "host arrays (torch.from_numpy / jax.device_put) inside the timed region.",
    "Blocking time: until the library's async save returns. orbax: StandardCheckpointer.save; "
    "DCP: dcp.async_save (stages a CPU copy); msgpack has no async API: blocking = "
    "flax.serialization.to_bytes, then a thread writes one file and fsyncs it.",
    "Durability: after every save, of every library and of the raw rows alike, the "
    "harness runs one fsync pass over what was written and counts it in the durable save "
    "(fsync_pass_s in the JSON): it completes orbax's save (orbax does not fsync every "
    "file) and finds little to do where a save was durable on return (the plugin, DCP "
    "with sync_files=True, msgpack and raw with their own fsync).",
    "Raw limit: the same bytes in one file, written by parallel os.pwrite calls (8 MiB "
    "blocks, --raw-streams threads) and one fsync, read back cold by as many threads of "
    "os.preadv into one buffer; ratios are to it. The single sequential stream (one "
    "write loop, one fsync; one readinto) is the second raw row.",
    "Every restore of every repeat is checked for leaf types, shapes, dtypes and "
    "shardings ('result checks' column); values are compared on the first repeat.",
    "Workload (c) for DCP and msgpack: single-process DCP and msgpack have no jax "
    "sharding; they save the gathered global arrays and restore with jax.device_put onto "
    "the target sharding, which is what a single-host user of them does.",
    "DCP runs in one process without init_process_group (no_dist=True), FileSystemWriter "
    "thread_count=2 (the machine's cores).",
    "orbax stores zstd-compressed zarr3/OCDBT chunks by default: smaller on disk, more CPU.",
    "On CPU neither orbax's blocking phase nor the plugin's copies anything: both hold "
    "zero-copy numpy views of the jax CPU buffers, and jax neither donates nor frees a "
    "buffer while such a view lives (a donating step allocates a new output instead), so "
    "the views are snapshots (the plugin checks this at run time and copies otherwise; "
    "tests/core/test_save.py). On a GPU the device-to-host copy is a real transfer "
    "(gpu_check.sh).",
    "The disk is a virtual disk: drop_caches empties this machine's page cache, but the "
    "host under it may still cache the file, so 'cold' reads can run faster than the "
    "device would. Other sessions share the machine; each run records the load average "
    "(loadavg_1m in the JSON).",
    "Peak RSS is measured as VmHWM above the RSS just before the operation, in a fresh "
    "process per operation; bytes read come from /proc/self/io read_bytes after "
    "drop_caches.",
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="repeats of every workload")
    p.add_argument(
        "--repeats-c", type=int, default=None, help="repeats for workload (c) (default: --repeats)"
    )
    C.add_raw_and_tiny_options(p)
    p.add_argument("--workloads", default="abc")
    p.add_argument("--libs", default=",".join(LIBRARIES))
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--train-every", type=int, default=10)
    p.add_argument("--train-rounds", type=int, default=2, help="repeats")
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one repeat everywhere, fewer training steps, no verification",
    )
    p.add_argument(
        "--reuse-runs",
        metavar="JSON",
        help="take the save/restore runs from an earlier peers.json; measure the rest",
    )
    p.add_argument(
        "--report-only",
        metavar="JSON",
        help="rebuild the Markdown/PNG/targets from an earlier peers.json; run nothing",
    )
    a = p.parse_args(argv)
    if a.report_only:
        import json

        with open(a.report_only) as f:
            old = json.load(f)
        H.write_outputs(
            "peers",
            "Checkpointing libraries side by side (issue 5)",
            old["runs"],
            old["train"],
            H.peer_targets,
            notes=NOTES,
            config=old.get("config"),
            machine=old.get("machine"),
        )
        return
    if a.quick:
        a.repeats = a.repeats_c = 1
        a.train_steps = 10
        a.train_every = 5
        a.train_rounds = 1
    if a.repeats_c is None:
        a.repeats_c = a.repeats
    if a.tiny:
        os.environ[C.SIZE_ENV] = "tiny"  # inherited by every worker and train_loop.py
    if not C.is_root():
        print(C.COLD_NOTE)
    libs = ["raw", "raw1"] + [x for x in a.libs.split(",") if x]
    t0 = time.perf_counter()
    rows = []
    if a.reuse_runs:  # e.g. to rerun only the training loop
        import json

        with open(a.reuse_runs) as f:
            rows = json.load(f)["runs"]
        a.workloads = ""
    for w in a.workloads:
        reps = a.repeats_c if w == "c" else a.repeats
        rows += H.run_matrix(
            libs, [w], reps, verify=not (a.no_verify or a.quick), streams=a.raw_streams
        )
    train = (
        []
        if a.no_train
        else H.run_train(
            [x for x in libs if x not in H.RAW], a.train_steps, a.train_every, a.train_rounds
        )
    )
    _, _, failed = H.write_outputs(
        "peers-tiny" if a.tiny else "peers",  # a check run never replaces the results
        "Checkpointing libraries side by side (issue 5)",
        rows,
        train,
        H.peer_targets,
        notes=NOTES,
        config=vars(a) | {"wall_s": time.perf_counter() - t0},
    )
    H.log(f"done in {time.perf_counter() - t0:.0f}s")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
