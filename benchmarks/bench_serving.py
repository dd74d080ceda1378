"""Serving at the read limit (issue 34 item 6): a cold params-only restore of workload (a).

Saves workload (a) (~1.2 GB: params + Adam mu/nu) once with a fop CheckpointManager
(its defaults: params / opt_state items), once with torch DCP, and writes the params'
bytes to one raw file. Then, ``--repeats`` times, the order rotated each repeat, each
measurement cold (every file of what it reads evicted from the page cache with
``POSIX_FADV_DONTNEED`` first: other processes' caches stay) and in a fresh subprocess:

* ``fop``: ``fop.restore_params(directory, like=<ShapeDtypeStructs on one CPU device>)``
  (``--code`` DIR, repeatable: the same measurement with the library imported from each
  checkout, e.g. main's code and a branch's, side by side in one run);
* ``dcp``: DCP's params-only load (as ``peers/torch_dcp.py``: preallocated tensors,
  ``dcp.load``, ``jax.device_put``);
* ``raw8`` / ``raw1``: the same params bytes read from the raw file by 8 (1) threads of
  ``os.preadv`` into one buffer allocated in the timed region (first touched by the
  reads, as a restore's are); the faster is the limit. ``raw8t``: 8 threads into a
  buffer allocated and touched before the clock (the disk alone).

Each figure: the subprocess's wall time (start to exit: imports, jit, the call) and the
call's own time in the process; medians, ratios to the raw read (the faster of raw8 and
raw1, per the same repeat's figure; and to raw8t), and the one-minute load and CPU steal of the
machine beside each. Writes ``results/serving.{json,md}``.

    python benchmarks/bench_serving.py --code /tmp/fop-main --code . --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402
import machine_load  # noqa: E402

RAW_KINDS = ("raw8", "raw1", "raw8t")


def raw_read(path: str, streams: int, *, touched: bool, t0: float, out: dict) -> int:
    """The params' bytes from the raw file by ``streams`` threads of ``os.preadv`` (8 MiB
    blocks) into one buffer, allocated as the library allocates its own (no transparent
    huge pages: numpy's default asks for them, and the kernel's compaction for them
    made a fresh buffer's first touch several times slower here). ``touched``: the
    buffer is allocated and written before the clock starts (the disk alone); else its
    allocation and first touch are timed, as a restore's are. Sets ``out["t0"]``."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:  # other numpy layouts
        _set_madvise_hugepage = None
    if _set_madvise_hugepage:
        _set_madvise_hugepage(False)
    nbytes = os.path.getsize(path)
    pool = ThreadPoolExecutor(streams)
    list(pool.map(lambda _: None, range(streams)))  # the threads started: both ways
    if touched:
        buf = np.empty(nbytes, np.uint8)
        buf.fill(1)
        t0 = time.perf_counter()
    else:
        t0 = time.perf_counter()
        buf = np.empty(nbytes, np.uint8)
    out["t0"] = t0
    try:
        C.read_blocks(path, buf, pool)
    finally:
        pool.shutdown()
    return int(buf.nbytes)


# ----------------------------------------------------------------------- workers


def _like_params():
    import jax

    C.tree_specs("a")  # (sizes from the env: tiny or not)
    specs = C.params_specs(C.tree_specs("a"))
    like = C.build_like(specs, "single")
    jax.devices()  # backend started before the call (as a serving process has it)
    return specs, like["params"]


def worker(kind: str, path: str, code: str | None) -> dict:
    t_start = time.perf_counter()
    out: dict = {}
    if kind.startswith("raw"):
        streams = int(kind[3:].rstrip("t"))
        t0 = time.perf_counter()
        out["bytes"] = raw_read(path, streams, touched=kind.endswith("t"), t0=t0, out=out)
        out["call_s"] = time.perf_counter() - out.pop("t0")
    elif kind == "dcp":
        import jax
        from peers import torch_dcp

        specs, like = _like_params()
        adapter = torch_dcp.Adapter()
        t0 = time.perf_counter()
        tree = adapter.restore_params(path, like)
        jax.block_until_ready(tree)
        out["call_s"] = time.perf_counter() - t0
        out["problems"] = C.check_result({"params": tree}, specs, "single")
    elif kind == "fop" or kind.startswith("fop-partial"):
        import jax

        import flax_orbax_plugin as fop

        where = os.path.realpath(fop.__file__)
        if code and not where.startswith(os.path.realpath(code) + os.sep):
            raise SystemExit(f"flax_orbax_plugin imported from {where}, not {code}")
        specs, like = _like_params()
        t0 = time.perf_counter()
        restore_params = fop.restore_params  # its first use imports the public API
        out["import_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if kind == "fop":
            tree = restore_params(path, like=like)
        else:  # peers/fop.py's restore_params (bench_peers): the whole state's checkpoint
            tree = fop.restore(path, {"params": like}, partial=True)["params"]
        jax.block_until_ready(tree)
        out["call_s"] = time.perf_counter() - t0
        out["problems"] = C.check_result({"params": tree}, specs, "single")
        out["module"] = where
    else:
        raise SystemExit(f"unknown kind {kind}")
    out["in_process_s"] = time.perf_counter() - t_start
    io = C.io_counters()
    out["read_bytes"] = io.get("read_bytes", 0)
    return out


# ------------------------------------------------------------------------ driver


def cached_fraction(path: str) -> float | None:
    """The share of ``path``'s pages in the page cache (mincore on a mapping), or None."""
    try:
        import ctypes
        import mmap

        files = [path] if os.path.isfile(path) else []
        for root, _dirs, names in os.walk(path):
            files += [os.path.join(root, n) for n in names]
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        total = cached = 0
        for f in files:
            size = os.path.getsize(f)
            if size == 0:
                continue
            with open(f, "rb") as fh:
                m = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            anchor = ctypes.c_char.from_buffer(m)
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), size, vec)
            del anchor
            m.close()
            if rc == 0:
                total += pages
                cached += sum(v & 1 for v in bytes(vec))
        return cached / total if total else None
    except Exception:  # noqa: BLE001  (a diagnostic only)
        return None


def _env(code: str | None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    # Byte code is compiled once (precompile) and read from then on, as an installed
    # package's is: with PYTHONDONTWRITEBYTECODE set every fresh process compiled the
    # library's sources again (0.25 s of its first call), while torch's are installed
    # compiled.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    paths = [HERE] + ([os.path.abspath(code)] if code else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def measure(kind: str, path: str, code: str | None, evict_paths: list[str]) -> dict:
    for p in evict_paths:
        C.evict(p)
    left = [cached_fraction(p) for p in evict_paths]
    steal0, total0 = machine_load.cpu_times()
    load0 = machine_load.load1()
    args = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--path", path]
    if code:
        args += ["--code", os.path.abspath(code)]
    t0 = time.perf_counter()
    proc = subprocess.run(args, env=_env(code), capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    steal1, total1 = machine_load.cpu_times()
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stdout}\n{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(
        wall_s=wall,
        load1=load0,
        steal=(steal1 - steal0) / max(1, total1 - total0),
        cached_before=max((x for x in left if x is not None), default=None),
    )
    return out


def precompile(code: str | None) -> None:
    """Byte-compiles the library at ``code`` (see ``_env``)."""
    if code:
        import compileall

        compileall.compile_dir(os.path.join(code, "flax_orbax_plugin"), quiet=1)


def save_all(root: str, code: str | None) -> dict:
    """Saves (a) with fop (manager) and DCP, and the params' raw bytes, in a subprocess."""
    args = [sys.executable, os.path.abspath(__file__), "--save", root]
    proc = subprocess.run(args, env=_env(code), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"save failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def do_save(root: str) -> dict:
    import jax
    import numpy as np
    from peers import torch_dcp

    import flax_orbax_plugin as fop

    specs = C.tree_specs("a")
    tree = C.build_jax_tree(specs, "single")
    paths = {k: os.path.join(root, k) for k in ("fop", "fop-single-v2", "fop-single-v1")}
    paths.update(dcp=os.path.join(root, "dcp"), raw=os.path.join(root, "raw"))
    for k in paths:
        C.rmtree(paths[k])
    mgr = fop.CheckpointManager(paths["fop"])
    mgr.save(1, tree)
    mgr.wait()
    mgr.close()
    fop.save(paths["fop-single-v2"], tree, format_version=2)
    fop.save(paths["fop-single-v1"], tree, format_version=1)
    torch_dcp.Adapter().save_async(paths["dcp"], tree).wait()
    params = [np.asarray(C.get_path(tree, s.path)) for s in C.params_specs(specs)]
    nbytes = C.raw_write(paths["raw"], params)
    for k in paths:
        C.fsync_tree(paths[k])
    os.sync()
    del jax
    return {
        "paths": paths,
        "params_bytes": nbytes,
        "total_bytes": C.total_bytes(specs),
        "fop_bytes": C.disk_usage(paths["fop"])[0],
        "dcp_bytes": C.disk_usage(paths["dcp"])[0],
        "fop_module": fop.__file__,
    }


def _median(xs):
    return C.median([x for x in xs if x is not None])


def summarize(runs: list[dict], labels: list[str]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["label"], []).append(r)

    def per_repeat(kinds: tuple[str, ...], key: str) -> dict[int, float]:
        best: dict[int, float] = {}
        for r in runs:
            if r["kind"] in kinds:
                best[r["repeat"]] = min(best.get(r["repeat"], r[key]), r[key])
        return best

    raw_by_rep = per_repeat(("raw8", "raw1"), "call_s")  # the limit: a fresh buffer
    disk_by_rep = per_repeat(("raw8t",), "call_s")  # the disk alone: a touched buffer
    raw_call = _median(raw_by_rep.values())
    out = {}
    for label in labels:
        rs = by.get(label, [])
        call = _median([r["call_s"] for r in rs])
        out[label] = {
            "n": len(rs),
            "call_s": call,
            "wall_s": _median([r["wall_s"] for r in rs]),
            "call_over_raw": call / raw_call if call and raw_call else None,
            "call_over_raw_per_repeat": _median(
                [r["call_s"] / raw_by_rep[r["repeat"]] for r in rs if r["repeat"] in raw_by_rep]
            ),
            "call_over_disk_per_repeat": _median(
                [r["call_s"] / disk_by_rep[r["repeat"]] for r in rs if r["repeat"] in disk_by_rep]
            ),
            "load1": _median([r["load1"] for r in rs]),
            "steal": _median([r["steal"] for r in rs]),
            "read_bytes": _median([r["read_bytes"] for r in rs]),
            "cached_before": _median([r["cached_before"] for r in rs]),
            "calls": [round(r["call_s"], 3) for r in rs],
            "import_s": _median([r.get("import_s") for r in rs]),
        }
    out["raw_limit_call_s"] = raw_call
    out["raw_limit_wall_s"] = _median(per_repeat(("raw8", "raw1"), "wall_s").values())
    out["disk_call_s"] = _median(disk_by_rep.values())
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        "# Serving: a cold params-only restore of workload (a)",
        "",
        f"{result['when']}; {result['repeats']} repeats, order rotated, each cold "
        f"(fadvise DONTNEED on its files) in a fresh subprocess. Params "
        f"{result['save']['params_bytes'] / 1e9:.3f} GB of a "
        f"{result['save']['total_bytes'] / 1e9:.3f} GB state. Machine: "
        f"{result['machine'].get('cpu_count', '?')} CPUs.",
        "",
        "call: the restore call in the process (for fop, after its first use of "
        "`fop.restore_params` imported the public API: import s); wall: the subprocess, "
        "start to exit (imports, backend, the call). Ratio: call / the raw read's "
        "(the faster of raw8 and raw1: a fresh buffer, as a restore has), median of each "
        "repeat's ratio; / disk: to raw8t's (a buffer allocated and touched before the "
        "clock: the disk alone). "
        "load: 1-minute load average before; steal: CPU steal share during.",
        "",
        "| what | call s (median) | wall s | call / raw | / disk | import s | read GB | load "
        "| steal | calls |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in result["labels"]:
        e = s[label]
        if not e["n"]:
            continue
        lines.append(
            f"| {label} | {e['call_s']:.3f} | {e['wall_s']:.2f} | "
            f"{e['call_over_raw_per_repeat']:.2f} | {e['call_over_disk_per_repeat'] or 0:.2f} | "
            f"{'' if e['import_s'] is None else format(e['import_s'], '.3f')} | "
            f"{(e['read_bytes'] or 0) / 1e9:.3f} | "
            f"{e['load1']:.1f} | {e['steal']:.3f} | {e['calls']} |"
        )
    raw = s["raw_limit_call_s"]
    lines += [
        "",
        f"raw limit (call, median of each repeat's faster of raw8 and raw1): {raw:.3f} s; "
        f"the disk alone (raw8t): {s['disk_call_s']:.3f} s",
    ]
    for note in result.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker")
    p.add_argument("--path")
    p.add_argument("--save")
    p.add_argument("--code", action="append", default=[])
    p.add_argument("--name", action="append", default=[], help="a label per --code")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--root", default=os.path.join(C.TMP, "serving2"))
    p.add_argument("--out", default=os.path.join(C.RESULTS, "serving"))
    p.add_argument("--no-dcp", action="store_true")
    p.add_argument(
        "--partial",
        action="store_true",
        help="also fop.restore(single, {'params': like}, partial=True) of a whole-state "
        "fop.save checkpoint, version 2 and 1 (peers/fop.py's restore_params)",
    )
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--keep", action="store_true", help="reuse a saved root")
    a = p.parse_args()
    if a.tiny:
        os.environ[C.SIZE_ENV] = "tiny"
    if a.worker:
        print(json.dumps(worker(a.worker, a.path, a.code[0] if a.code else None)))
        return
    if a.save:
        os.makedirs(a.save, exist_ok=True)
        print(json.dumps(do_save(a.save)))
        return
    codes = a.code or [None]
    names = a.name or [f"fop[{c or 'installed'}]" for c in codes]
    meta = os.path.join(a.root, "saved.json")
    if a.keep and os.path.exists(meta):
        with open(meta) as f:
            saved = json.load(f)
    else:
        os.makedirs(a.root, exist_ok=True)
        saved = save_all(a.root, codes[-1])
        with open(meta, "w") as f:
            json.dump(saved, f)
    paths = saved["paths"]
    for code in codes:
        precompile(code)
    jobs = [(name, "fop", paths["fop"], code) for name, code in zip(names, codes, strict=True)]
    if a.partial:
        for v in ("v2", "v1"):
            jobs += [
                (f"{name} partial {v}", f"fop-partial-{v}", paths[f"fop-single-{v}"], code)
                for name, code in zip(names, codes, strict=True)
            ]
    if not a.no_dcp:
        jobs.append(("dcp", "dcp", paths["dcp"], None))
    jobs += [(k, k, paths["raw"], None) for k in RAW_KINDS]
    runs = []
    every = list(paths.values())
    for rep in range(a.repeats):
        k = rep % len(jobs)
        for label, kind, path, code in jobs[k:] + jobs[:k]:
            r = measure(kind, path, code, every)
            r.update(label=label, kind=kind, repeat=rep)
            runs.append(r)
            print(
                f"rep {rep} {label:>24}: call {r['call_s']:.3f}s wall {r['wall_s']:.2f}s "
                f"load {r['load1']:.1f} steal {r['steal']:.3f} "
                f"read {r['read_bytes'] / 1e9:.3f}GB cached {r['cached_before']}",
                flush=True,
            )
            if r.get("problems"):
                raise SystemExit(f"{label}: {r['problems'][:3]}")
    labels = [j[0] for j in jobs]
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "repeats": a.repeats,
        "labels": labels,
        "codes": dict(zip(names, codes, strict=True)),
        "save": saved,
        "machine": C.machine_description(),
        "summary": summarize(runs, labels),
        "runs": runs,
    }
    with open(a.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
