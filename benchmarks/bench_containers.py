"""Container candidates for format version 2 (issue 27), measured side by side in one run.

    python benchmarks/bench_containers.py [--size tiny|medium] [--repeats 3]
                                          [--s3-repeats 1] [--no-s3] [--workloads a b]

The same state is saved and restored by three containers:

* ``v2``: this library's own (``fop.save(..., format_version=2)``, ``fop.restore``):
  every chunk of a process in a few data files plus one JSON index per process;
* ``zarr3-shard``: tensorstore's zarr3 driver, one array per leaf, the
  ``sharding_indexed`` codec with one shard per array (a large shard), inner chunks as
  ours (``_zarr.arrays.chunk_shape``, ~4 MiB) with crc32c on each and on the index;
* ``ocdbt``: zarr3 arrays (the same chunks and crc32c, no sharding codec) as keys of
  one tensorstore OCDBT database per process (the layout Orbax writes; data files of
  tensorstore's default target size), all written under one shared context and one
  transaction (one commit), read with Orbax's read-coalescing options.

(ii) and (iii) are written directly with tensorstore here (no metadata of ours, no
commit marker; a rank-0 leaf is stored as shape (1,)). Workloads: "a", a
transformer-shaped float32 state with Adam mu/nu (``--size medium``, the default:
d=512, 6 layers, vocab 16384, ~330 MB; ``tiny``: common.py's tiny shapes); "b", the
6,000-leaf small tree of common.py (~200 MB; tiny: 600 leaves). Stores: the local disk
(``benchmarks/results/tmp``) and, unless ``--no-s3``, a moto S3 server in this process.
Reported per candidate and store: objects (files) per save, bytes stored, save time,
restore time (cold-ish: the tensorstore candidates open with a fresh context, so no
cache of theirs survives, and ``fop.restore`` keeps no chunk cache; the page cache is
not dropped, for all alike): medians of ``--repeats`` (on S3 of
``--s3-repeats``: 1 by default, to stay near 3 minutes a run; the zarr3 save of the
small tree alone is 12,000 PUTs), the candidates alternating within each repeat;
on S3 also the requests of the first save and restore, by kind. Prints one JSON line
per row, then a table.
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
sys.path[:0] = [os.path.join(ROOT, "tests", "support"), ROOT, HERE]

import common  # noqa: E402
import numpy as np  # noqa: E402

CANDIDATES = ("v2", "zarr3-shard", "ocdbt")
# Orbax's OCDBT read options (its ts_utils): neighbouring chunk reads merged into one
READ_COALESCING = {
    "experimental_read_coalescing_threshold_bytes": 1_000_000,
    "experimental_read_coalescing_merged_bytes": 500_000_000_000,
    "experimental_read_coalescing_interval": "1ms",
}
CRC = {"name": "crc32c"}
BYTES = {"name": "bytes", "configuration": {"endian": "little"}}


def _specs(workload: str, size: str) -> list[common.LeafSpec]:
    if size == "tiny" or workload == "b":
        return common.tree_specs(workload)
    shapes = common._transformer_params(d=512, layers=6, vocab=16384, ff=2048)
    out = []
    for role, prefix in enumerate((("params",), ("opt_state", "mu"), ("opt_state", "nu"))):
        for idx, (path, shape) in enumerate(shapes):
            out.append(common.LeafSpec(prefix + path, shape, "float32", (3, role, idx)))
    out.append(common.LeafSpec(("opt_state", "count"), (), "int32", (3, 9, 0)))
    return out


def _count(store) -> tuple[int, int]:
    """(objects, bytes) under ``store``: a directory, or an S3 location."""
    if isinstance(store, str):
        count = total = 0
        for root, _, names in os.walk(store):
            for name in names:
                count += 1
                total += os.path.getsize(os.path.join(root, name))
        return count, total
    kv = store.kvstore()
    keys = kv.list().result()
    return len(keys), sum(len(kv.read(k).result().value) for k in keys)


def _kv(store, sub: str = "") -> dict:
    if isinstance(store, str):
        return {"driver": "file", "path": os.path.join(store, sub).rstrip("/") + "/"}
    spec = dict(store.spec)
    spec["path"] = spec["path"] + (sub + "/" if sub else "")
    return spec


def _zarr_spec(kvstore: dict, array: np.ndarray, sharded: bool) -> dict:
    from flax_orbax_plugin._zarr import arrays

    shape = list(array.shape) or [1]
    inner = arrays.chunk_shape(tuple(shape), array.dtype.itemsize, must_divide=False)
    if sharded:
        sharding = {"chunk_shape": inner, "codecs": [BYTES, CRC], "index_codecs": [BYTES, CRC]}
        grid, codecs = shape, [{"name": "sharding_indexed", "configuration": sharding}]
    else:
        grid, codecs = inner, [BYTES, CRC]
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": shape,
            "data_type": array.dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "codecs": codecs,
        },
    }


def _ts_save(kind: str, store, leaves: list[np.ndarray]) -> None:
    import tensorstore as ts

    context = ts.Context()
    txn = ts.Transaction() if kind == "ocdbt" else None
    specs = []
    for i, array in enumerate(leaves):
        if kind == "ocdbt":
            kvstore = {"driver": "ocdbt", "base": _kv(store), "path": f"{i}/"}
        else:
            kvstore = _kv(store, str(i))
        specs.append(_zarr_spec(kvstore, array, sharded=kind == "zarr3-shard"))
    opened = [
        ts.open(s, create=True, delete_existing=False, context=context, transaction=txn)
        for s in specs
    ]
    writes = [
        f.result().write(a.reshape(a.shape or (1,))) for f, a in zip(opened, leaves, strict=True)
    ]
    for w in writes:
        w.result()
    if txn is not None:
        txn.commit_async().result()


def _ts_restore(kind: str, store, leaves: list[np.ndarray]) -> list[np.ndarray]:
    import tensorstore as ts

    context = ts.Context()  # fresh: no cache of an earlier open
    specs = []
    for i, array in enumerate(leaves):
        if kind == "ocdbt":
            kvstore = {"driver": "ocdbt", "base": _kv(store), "path": f"{i}/", **READ_COALESCING}
        else:
            kvstore = _kv(store, str(i))
        spec = _zarr_spec(kvstore, array, sharded=kind == "zarr3-shard")
        del spec["metadata"]  # read from zarr.json
        specs.append(spec)
    opened = [ts.open(s, open=True, read=True, context=context) for s in specs]
    reads = [f.result().read() for f in opened]
    return [r.result() for r in reads]


def _one(fop, kind: str, store, tree, leaves, url, path0, requests=None) -> dict:
    if requests is not None:
        requests.take()
    t = time.perf_counter()
    if kind == "v2":
        fop.save(url, tree, format_version=2)
    else:
        _ts_save(kind, store, leaves)
    save_s = time.perf_counter() - t
    saved = requests.take() if requests is not None else {}
    objects, nbytes = _count(store)
    if requests is not None:
        requests.take()
    t = time.perf_counter()
    if kind == "v2":
        first = np.asarray(common.get_path(fop.restore(url), path0))
    else:
        first = _ts_restore(kind, store, leaves)[0]
    restore_s = time.perf_counter() - t
    restored = requests.take() if requests is not None else {}
    np.testing.assert_array_equal(first.reshape(-1), leaves[0].reshape(-1), err_msg=kind)
    return {
        "save_s": save_s,
        "restore_s": restore_s,
        "objects": objects,
        "bytes": nbytes,
        "save_requests": saved,
        "restore_requests": restored,
    }


def _clear(store) -> None:
    if isinstance(store, str):
        shutil.rmtree(store, ignore_errors=True)
    else:
        kv = store.kvstore()
        for key in kv.list().result():
            kv.write(key, None).result()


def _measure(fop, workload, specs, stores, requests) -> list[dict]:
    tree = common.nest((s.path, s.make()) for s in specs)
    leaves = [common.get_path(tree, s.path) for s in specs]
    leaves = [np.asarray(a) for a in leaves]
    rows = []
    for store_name, make, repeats in stores:
        runs: dict[str, list[dict]] = {k: [] for k in CANDIDATES}
        for r in range(repeats):
            for kind in CANDIDATES:
                store, url = make(f"{workload}-{kind}-{r}")
                try:
                    counter = requests if store_name == "s3" else None
                    one = _one(fop, kind, store, tree, leaves, url, specs[0].path, counter)
                    runs[kind].append(one)
                    run = {"workload": workload, "store": store_name, "candidate": kind}
                    print(json.dumps({"run": r, **run, **one}), flush=True)
                finally:
                    _clear(store)
        for kind in CANDIDATES:
            got = runs[kind]
            row = {
                "workload": workload,
                "store": store_name,
                "candidate": kind,
                "leaves": len(specs),
                "state_bytes": common.total_bytes(specs),
                "objects": got[0]["objects"],
                "stored_bytes": got[0]["bytes"],
                "save_s": statistics.median(x["save_s"] for x in got),
                "restore_s": statistics.median(x["restore_s"] for x in got),
            }
            if store_name == "s3":
                row["save_requests"] = got[0]["save_requests"]
                row["restore_requests"] = got[0]["restore_requests"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["tiny", "medium"], default="medium")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--s3-repeats", type=int, default=1)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--workloads", nargs="+", default=["a", "b"], choices=["a", "b"])
    args = p.parse_args()
    if args.size == "tiny":
        os.environ[common.SIZE_ENV] = "tiny"
    import flax_orbax_plugin as fop

    directory = os.path.join(common.TMP, "bench_containers")
    os.makedirs(directory, exist_ok=True)

    def local(name):
        path = os.path.join(directory, name)
        return path, path

    stores = [("local", local, args.repeats)]
    server = undo = requests = None
    if not args.no_s3:
        from _s3_requests import S3Requests
        from _s3_server import S3Server

        server = S3Server(mode="thread").start()
        requests = S3Requests().__enter__()
        undo = server.apply_env()
        bucket = server.create_bucket()

        def s3(name):
            where = server.location(bucket, name)
            return where, where.url

        stores.append(("s3", s3, args.s3_repeats))
    print(json.dumps({"loadavg_before": os.getloadavg()}), flush=True)
    rows = []
    try:
        for workload in args.workloads:
            specs = _specs(workload, args.size)
            rows += _measure(fop, workload, specs, stores, requests)
    finally:
        if server is not None:
            requests.__exit__(None, None, None)
            undo()
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps({"loadavg_after": os.getloadavg()}), flush=True)
    print()
    print("| workload | store | candidate | objects | save s | restore s | PUTs | GETs |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        puts = sum(v for k, v in r.get("save_requests", {}).items() if k.startswith("PUT"))
        gets = sum(v for k, v in r.get("restore_requests", {}).items() if k.startswith("GET"))
        print(
            f"| {r['workload']} ({r['leaves']} leaves, {r['state_bytes'] / 1e6:.0f} MB) | "
            f"{r['store']} | {r['candidate']} | {r['objects']} | {r['save_s']:.2f} | "
            f"{r['restore_s']:.2f} | {puts if 'save_requests' in r else ''} | "
            f"{gets if 'restore_requests' in r else ''} |"
        )


if __name__ == "__main__":
    main()
