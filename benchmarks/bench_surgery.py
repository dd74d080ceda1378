"""Issue 36, items 2 and 4: the bytes a layout-surgery restore reads against its
target's bytes (target: within 5%), and its time against a plain restore of the same
saved leaves.

    python benchmarks/bench_surgery.py [--layers 8] [--mib 4] [--repeats 5] [--format-versions 1,2]

On 8 host devices (XLA_FLAGS). Saves ``--layers`` per-layer leaves of ``--mib`` MiB
each (float32, 1024 columns) and the same leaves stacked, then per case restores with
``surgery=`` and, alternating within each repeat so machine noise hits both alike, the
plain restore it stands for:

* ``stack/layers``: per-layer leaves into one stacked leaf sharded over layers (8
  devices); plain: the per-layer leaves as saved.
* ``stack/rows``: the same, sharded over rows and columns (4 x 2 devices).
* ``unstack one``: layer 3 out of the stacked leaf (``partial=True``); plain: a
  per-layer leaf as saved.
* ``split k``: the middle third (columns) of a fused QKV leaf, sharded over columns;
  plain: a leaf of the same shape as saved. Chunks are cut along rows, so this reads
  every chunk of the fused leaf (3x): the format's chunk geometry, not the surgery.
* ``split rows``: the middle third of a leaf fused along rows (its chunks' axis).

Bytes read are the kernel's ``rchar`` of this process (metadata included), median of
the repeats; times are medians. Beside each row: the 1-minute load average at its end
and the CPU share stolen by the hypervisor meanwhile (``/proc/stat``). Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from machine_load import cpu_times, load1  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402

COLS = 1024


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _sharding(spec: PartitionSpec, shape: tuple[int, ...]) -> NamedSharding:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("a", "b")[: len(shape)])
    return NamedSharding(mesh, spec)


def _timed(fn) -> tuple[float, int, object]:
    before, start = _rchar(), time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, _rchar() - before, out


def _cases(work: str, layers: int, rows: int, version: int):
    """``(name, target bytes, surgery restore, plain restore, check)`` per case."""
    rng = np.random.default_rng(0)
    per = {
        f"layers_{i}": {"w": rng.standard_normal((rows, COLS), np.float32)} for i in range(layers)
    }
    w = np.stack([per[f"layers_{i}"]["w"] for i in range(layers)])
    qkv = rng.standard_normal((rows, 3 * COLS), np.float32)
    per_path, stk_path = os.path.join(work, f"per{version}"), os.path.join(work, f"stk{version}")
    fop.save(per_path, per, format_version=version)
    fop.save(
        stk_path,
        {"w": w, "qkv": qkv, "k": qkv[:, COLS : 2 * COLS].copy(), "rows": qkv.T.copy()},
        format_version=version,
    )
    stack = [fop.Stack("w", "layers_{i}/w")]
    for name, spec, mesh in [
        ("stack/layers", PartitionSpec("a"), (8,)),
        ("stack/rows", PartitionSpec(None, "a", "b"), (4, 2)),
    ]:
        like = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=_sharding(spec, mesh))}
        inner = PartitionSpec(*tuple(spec)[1:])
        plain_like = {
            k: {
                "w": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=_sharding(inner, mesh))
            }
            for k in per
        }
        yield (
            name,
            w.nbytes,
            lambda like=like: fop.restore(per_path, like, partial=True, surgery=stack),
            lambda plain_like=plain_like: fop.restore(per_path, plain_like),
            lambda out: np.array_equal(np.asarray(out["w"]), w),
        )
    one = {"layers_3": {"w": np.zeros((rows, COLS), np.float32)}}
    unstack = [fop.Unstack("w", "layers_{i}/w")]
    yield (
        "unstack one",
        w[3].nbytes,
        lambda: fop.restore(stk_path, one, partial=True, surgery=unstack),
        lambda: fop.restore(per_path, one, partial=True),
        lambda out: np.array_equal(out["layers_3"]["w"], w[3]),
    )
    k_like = jax.ShapeDtypeStruct(
        (rows, COLS), np.float32, sharding=_sharding(PartitionSpec(None, "a"), (8,))
    )
    split = [fop.Split("qkv", ["q", "k2", "v"], axis=1), fop.Rename("k2", "kk")]
    yield (
        "split k",
        rows * COLS * 4,
        lambda: fop.restore(stk_path, {"kk": k_like}, partial=True, surgery=split),
        lambda: fop.restore(stk_path, {"k": k_like}, partial=True),
        lambda out: np.array_equal(np.asarray(out["kk"]), qkv[:, COLS : 2 * COLS]),
    )
    yield _split_rows(stk_path, rows, qkv)


def _split_rows(stk_path: str, rows: int, qkv: np.ndarray):
    """The middle third of a leaf fused along rows (the axis its chunks are cut on)."""
    sharding = _sharding(PartitionSpec("a"), (8,))
    like = jax.ShapeDtypeStruct((COLS, rows), np.float32, sharding=sharding)
    plain = jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sharding)
    split = [fop.Split("rows", ["r0", "r1", "r2"], axis=0)]
    want = qkv.T[COLS : 2 * COLS]
    return (
        "split rows",
        want.nbytes,
        lambda: fop.restore(stk_path, {"r1": like}, partial=True, surgery=split),
        lambda: fop.restore(stk_path, {"k": plain}, partial=True),
        lambda out: np.array_equal(np.asarray(out["r1"]), want),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mib", type=float, default=4, help="MiB per layer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--format-versions", default="1,2")
    args = p.parse_args()
    rows = max(8, int(args.mib * (1 << 20)) // (4 * COLS) // 8 * 8)
    work = tempfile.mkdtemp(prefix="fop-surgery-")
    out_rows = []
    try:
        for version in [int(v) for v in args.format_versions.split(",")]:
            for name, want, surgery, plain, check in _cases(work, args.layers, rows, version):
                surgery(), plain()  # warm: compiled placements, page cache
                ts, tp, reads = [], [], []
                s0, t0 = cpu_times()
                for _ in range(args.repeats):
                    t, nbytes, out = _timed(surgery)
                    assert check(out), name
                    ts.append(t)
                    reads.append(nbytes)
                    tp.append(_timed(plain)[0])
                s1, t1 = cpu_times()
                read = statistics.median(reads)
                t_s, t_p = statistics.median(ts), statistics.median(tp)
                out_rows.append(
                    f"| {version} | {name} | {want:,} | {read:,.0f} | {read / want:.3f} "
                    f"| {t_s:.4f} | {t_p:.4f} | {t_s / t_p:.2f} | {load1():.2f} "
                    f"| {(s1 - s0) / max(1, t1 - t0):.1%} |"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.layers} layers of {rows} x {COLS} float32, median of {args.repeats}\n")
    print(
        "| format | case | target bytes | bytes read | ratio | surgery s | plain s "
        "| ratio | load1 | steal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(out_rows))


if __name__ == "__main__":
    main()
