"""Files and requests per checkpoint, format version 1 against version 2, in one run.

    python benchmarks/bench_objects.py [--tiny] [--repeats 3] [--no-s3] [--workloads a b]

For each workload of ``common.py`` ("a": the ~1.2 GB transformer-shaped state with Adam
moments; "b": the ~6,000-leaf small tree), one process saves the tree as numpy arrays
with ``fop.save(..., format_version=v)`` for v in 1, 2 into a local directory
(``benchmarks/results/tmp``) and restores it with ``fop.restore`` (numpy, no
template), alternating the versions ``--repeats`` times. Reported per version: files
per save, bytes on disk, save and restore time (medians; the page cache is not
dropped: both versions are measured alike). Then, unless ``--no-s3``, the same save and
restore once against a moto S3 server in this process (``tests/support/_s3_server.py``),
counting the requests it answers by kind (``tests/support/_s3_requests.py``) and the
objects written. Prints one JSON object per measurement and a table at the end.
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


def _tree(workload: str) -> dict:
    specs = common.tree_specs(workload)
    return common.nest((s.path, s.make()) for s in specs), common.total_bytes(specs)


def _files(path: str) -> tuple[int, int]:
    count = total = 0
    for root, _, names in os.walk(path):
        for name in names:
            count += 1
            total += os.path.getsize(os.path.join(root, name))
    return count, total


def _local(fop, tree, version: int, directory: str) -> dict:
    path = os.path.join(directory, f"v{version}")
    shutil.rmtree(path, ignore_errors=True)
    t = time.perf_counter()
    fop.save(path, tree, format_version=version)
    save_s = time.perf_counter() - t
    files, nbytes = _files(path)
    t = time.perf_counter()
    fop.restore(path)
    restore_s = time.perf_counter() - t
    shutil.rmtree(path, ignore_errors=True)
    return {"save_s": save_s, "restore_s": restore_s, "files": files, "bytes": nbytes}


def _counter():
    from _s3_requests import S3Requests

    return S3Requests()


def _s3(fop, tree, version: int, server, requests) -> dict:
    bucket = server.create_bucket()
    location = server.location(bucket, f"v{version}")
    requests.take()
    t = time.perf_counter()
    fop.save(location.url, tree, format_version=version)
    save_s = time.perf_counter() - t
    requests.settle()
    saved = requests.take()
    objects = len(location.keys())
    t = time.perf_counter()
    fop.restore(location.url)
    restore_s = time.perf_counter() - t
    requests.settle()
    restored = requests.take()
    for key in location.keys():
        location.delete(key)  # moto keeps objects in memory
    return {
        "objects": objects,
        "save_requests": saved,
        "restore_requests": restored,
        "save_s": save_s,
        "restore_s": restore_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a few MiB per workload")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--workloads", nargs="+", default=["a", "b"], choices=["a", "b"])
    args = p.parse_args()
    if args.tiny:
        os.environ[common.SIZE_ENV] = "tiny"
    import flax_orbax_plugin as fop

    directory = os.path.join(common.TMP, "bench_objects")
    os.makedirs(directory, exist_ok=True)
    rows = []
    for workload in args.workloads:
        tree, nbytes = _tree(workload)
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for _ in range(args.repeats):
            for version in (1, 2):
                runs[version].append(_local(fop, tree, version, directory))
        for version in (1, 2):
            r = runs[version]
            row = {
                "workload": workload,
                "store": "local",
                "version": version,
                "state_bytes": nbytes,
                "files": r[0]["files"],
                "disk_bytes": r[0]["bytes"],
                "save_s": statistics.median(x["save_s"] for x in r),
                "restore_s": statistics.median(x["restore_s"] for x in r),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        if not args.no_s3:
            from _s3_server import S3Server

            server = S3Server(mode="thread").start()
            undo = server.apply_env()
            try:
                with _counter() as requests:
                    for version in (1, 2):
                        row = {"workload": workload, "store": "s3", "version": version}
                        row.update(_s3(fop, tree, version, server, requests))
                        print(json.dumps(row), flush=True)
                        rows.append(row)
            finally:
                undo()
                server.stop()
        del tree
    shutil.rmtree(directory, ignore_errors=True)
    print()
    for row in rows:
        if row["store"] == "local":
            print(
                f"{row['workload']} local v{row['version']}: {row['files']:5d} files, "
                f"save {row['save_s']:.3f} s, restore {row['restore_s']:.3f} s"
            )
        else:
            print(
                f"{row['workload']} s3    v{row['version']}: {row['objects']:5d} objects, "
                f"save requests {row['save_requests']}, restore requests "
                f"{row['restore_requests']}, save {row['save_s']:.2f} s, "
                f"restore {row['restore_s']:.2f} s"
            )


if __name__ == "__main__":
    main()
