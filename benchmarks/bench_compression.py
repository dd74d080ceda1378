"""Issue 16, point 4: what zstd (a zarr3 codec in tensorstore) would buy per item.

    python benchmarks/bench_compression.py [--max-mb 150] [--levels 1,3] [--workloads ab]

Writes the leaves of the benchmark workloads (see common.py: (a) transformer-shaped
training state, (b) ~6,000 small arrays) the way the core lays them out -- leaves
over 1 MiB as their own zarr3 arrays with the core's chunk shapes, smaller ones
concatenated into 16 MiB batch arrays of checksummed 64 KiB inner chunks -- once
with the core's codecs (``bytes``, ``crc32c``) and once per zstd level (``bytes``,
``zstd``, ``crc32c``). For each: bytes on disk, the durable write time (data
written, then ``syncfs``) and a warm read time (page cache kept: this measures
decompression, not the disk). ``--max-mb`` takes a prefix of each workload's leaves,
in order (params, then mu, then nu), so the run fits a shared machine.

This script uses tensorstore directly: the core has no compression option (see
the issue 16 report: the codec has to be recorded in a leaf's metadata, a change of
the on-disk format). Writes benchmarks/results/compression.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import tensorstore as ts

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import common  # noqa: E402

from flax_orbax_plugin import _arrays  # noqa: E402
from flax_orbax_plugin._storage import Location  # noqa: E402

SMALL = 1 << 20  # the core batches leaves up to this size


def _codecs(level: int | None) -> list[dict]:
    codecs: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if level is not None:
        codecs.append({"name": "zstd", "configuration": {"level": level, "checksum": False}})
    return codecs + [{"name": "crc32c"}]


def _spec(root: Location, sub: str, shape, chunk, inner, level) -> dict:
    spec = _arrays.spec(root, sub, shape, "float32", chunk, 4, inner_chunk=inner)
    codecs = spec["metadata"]["codecs"]
    if inner is None:
        spec["metadata"]["codecs"] = _codecs(level)
    else:
        codecs[0]["configuration"]["codecs"] = _codecs(level)
    return spec


def _plan(specs, max_bytes):
    """[(name, data, chunk, inner)]: big leaves alone, small ones in 16 MiB batches."""
    out, batch, batch_bytes, total = [], [], 0, 0
    for i, s in enumerate(specs):
        if total >= max_bytes:
            break
        if s.dtype != "float32":
            continue
        data = s.make()
        total += data.nbytes
        if data.nbytes > SMALL:
            chunk = _arrays.chunk_shape(tuple(data.shape), 4, must_divide=False)
            out.append((f"d{i}", data, chunk, None))
            continue
        batch.append(data.reshape(-1))
        batch_bytes += data.nbytes
        if batch_bytes >= _arrays.BATCH_CHUNK_BYTES:
            out.append(_batch(len(out), batch))
            batch, batch_bytes = [], 0
    if batch:
        out.append(_batch(len(out), batch))
    return out, total


def _batch(n, parts):
    flat = np.concatenate(parts)
    chunk = [max(1, _arrays.BATCH_CHUNK_BYTES // 4)]
    inner = [max(1, _arrays.BATCH_INNER_CHUNK_BYTES // 4)]
    return (f"b{n}", flat, chunk, inner)


def _syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "syncfs"):
            os.syncfs(fd)
        else:  # pragma: no cover
            os.sync()
    finally:
        os.close(fd)


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(plan, level, workdir) -> dict:
    root = Location.from_path(os.path.join(workdir, f"zstd{level}" if level else "plain"))
    t0 = time.perf_counter()
    futures = []
    for name, data, chunk, inner in plan:
        store = ts.open(
            _spec(root, name, data.shape, chunk, inner, level), create=True, open=True
        ).result()
        futures.append(store.write(data))
    for f in futures:
        f.result()
    _syncfs(root.path)
    write_s = time.perf_counter() - t0
    on_disk = _disk_bytes(root.path)
    t0 = time.perf_counter()
    for name, data, chunk, inner in plan:
        store = ts.open(_spec(root, name, data.shape, chunk, inner, level), open=True).result()
        got = store.read().result()
        if not np.array_equal(got, data):
            raise AssertionError(f"{name}: read back differs")
    read_s = time.perf_counter() - t0
    shutil.rmtree(root.path)
    return {"level": level, "bytes_on_disk": on_disk, "write_s": write_s, "read_warm_s": read_s}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workloads", default="ab")
    p.add_argument("--max-mb", type=float, default=150.0, help="bytes of each workload used")
    p.add_argument("--levels", default="1,3", help="zstd levels besides no compression")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args(argv)
    levels = [None] + [int(x) for x in a.levels.split(",") if x]
    rows = []
    workdir = tempfile.mkdtemp(prefix="fop-zstd-", dir=os.environ.get("FOP_BENCH_TMP"))
    try:
        for w in a.workloads:
            plan, total = _plan(common.tree_specs(w), a.max_mb * 1e6)
            for level in levels:
                samples = [measure(plan, level, workdir) for _ in range(a.repeats)]
                best = {
                    k: float(np.median([s[k] for s in samples]))
                    for k in ("bytes_on_disk", "write_s", "read_warm_s")
                }
                rows.append({"workload": w, "array_bytes": total, "level": level, **best})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(common.RESULTS, exist_ok=True)
    with open(os.path.join(common.RESULTS, "compression.json"), "w") as f:
        json.dump({"config": vars(a), "rows": rows}, f, indent=1)
    lines = [
        "# zstd per item (issue 16): bytes on disk and time, tensorstore zarr3 codecs",
        "",
        f"Config: {vars(a)}. Values are the benchmark workloads' (uniform random float32).",
        "",
        "| workload | codec | array MB | on disk MB | ratio | durable write s | warm read s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        codec = "none (crc32c)" if r["level"] is None else f"zstd level {r['level']}"
        lines.append(
            f"| {r['workload']} | {codec} | {r['array_bytes'] / 1e6:.1f} | "
            f"{r['bytes_on_disk'] / 1e6:.1f} | {r['bytes_on_disk'] / r['array_bytes']:.3f} | "
            f"{r['write_s']:.2f} | {r['read_warm_s']:.2f} |"
        )
    with open(os.path.join(common.RESULTS, "compression.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
