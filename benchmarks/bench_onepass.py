"""Copy and checksum in one pass, a GIL-releasing crc32c, the pool reserved before the
loop (issue 34, items 2 and 4).

    python benchmarks/bench_onepass.py [--mib 1200] [--repeats 5] [--out onepass.json]
                                       [--only gil,phases,first,kernel,save]

1. **gil**: a "training" thread runs a busy Python loop while 8 (then 1) threads checksum 4 MiB
   numpy chunks, with ``google_crc32c`` and with ``crc32c``: the training thread's
   waits (an iteration more than 1 ms longer than the median iteration alone: it
   waited for the GIL or a core), their median, p90 and max, the seconds waited per
   second, and the loop's work done against the same seconds alone.
2. **phases**: process CPU seconds (user + system, ``resource.getrusage``) of copying a
   state into pooled buffers and checksumming every 4 MiB chunk: the old way (copy,
   then crc32c from DRAM) against one pass (``_base.host.copy_all`` with
   checksums, each chunk checksummed as it is copied); medians of ``--repeats``.
3. **first**: a manager's first save against a steady one, wall and CPU seconds of the
   blocking phase, with and without ``CheckpointManager.reserve`` before the first.

4. **save**: a manager's steady saves (format version 2) with the one pass off and on
   (with the kernel and in Python), alternated: the blocking phase's wall seconds and the
   whole save's CPU seconds.
5. **kernel**: one thread's GB/s over 256 MiB (medians): np.copyto, the crc32c package,
   both one after the other, and ``_copycrc.copy_crc`` in each of its ways (SSE4.2 with
   cached stores, with non-temporal stores, the portable C path).

Load average and /proc/stat steal are recorded beside each figure. Writes
``results/onepass.json`` (``--out``: another name).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import resource
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from machine_load import cpu_times, load1  # noqa: E402

CHUNK = 4 << 20


class _Machine:
    """Load and steal over one figure."""

    def __enter__(self):
        self.steal0, self.total0 = cpu_times()
        return self

    def __exit__(self, *exc):
        steal, total = cpu_times()
        self.figures = {
            "load1": load1(),
            "steal_pct": round(100 * (steal - self.steal0) / max(1, total - self.total0), 2),
        }


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ------------------------------------------------------------------------------ gil


def _busy(stop: threading.Event, times: list[float]) -> None:
    """The training thread: a pure Python loop of ~0.2 ms iterations."""
    while not stop.is_set():
        t = time.perf_counter()
        x = 0
        for i in range(3000):
            x += i * i
        times.append(time.perf_counter() - t)


def gil_stall(seconds: float, threads: int = 8) -> dict:
    import google_crc32c
    import numpy as np
    from crc32c import crc32c

    data = np.random.default_rng(0).integers(0, 255, 64 * CHUNK, dtype=np.uint8)
    data.flags.writeable = False  # google_crc32c takes read-only buffers only
    chunks = [data[i : i + CHUNK] for i in range(0, data.size, CHUNK)]
    kinds = {
        "google_crc32c": lambda c: google_crc32c.value(c),
        "crc32c": lambda c: crc32c(c),
    }
    alone: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=_busy, args=(stop, alone))
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join()
    base = statistics.median(alone)
    out: dict = {"iteration_alone_ms": base * 1e3, "iterations_alone": len(alone)}
    for name, fn in kinds.items():
        stop = threading.Event()

        def checksummer(fn=fn, stop=stop):
            calls = 0
            while not stop.is_set():
                for c in chunks:
                    fn(c)
                    calls += 1
                    if stop.is_set():
                        break
            return calls

        times: list[float] = []
        with _Machine() as m, concurrent.futures.ThreadPoolExecutor(threads) as ex:
            futures = [ex.submit(checksummer) for _ in range(threads)]
            trainer = threading.Thread(target=_busy, args=(stop, times))
            trainer.start()
            time.sleep(seconds)
            stop.set()
            trainer.join()
            calls = sum(f.result() for f in futures)
        stalls = [(x - base) * 1e3 for x in times if x - base > 1e-3] or [0.0]
        out[name] = {
            "waits": len(stalls),
            "wait_ms_median": round(statistics.median(stalls), 2),
            "wait_ms_p90": round(_pct(stalls, 0.9), 2),
            "wait_ms_max": round(max(stalls), 2),
            "waited_s_per_s": round(sum(stalls) / 1e3 / seconds, 3),
            "work_vs_alone": round(len(times) / max(1, len(alone)), 3),
            "checksum_GBps": round(calls * CHUNK / seconds / 1e9, 2),
            **m.figures,
        }
        print(name, threads, json.dumps(out[name]), flush=True)
    return out


# --------------------------------------------------------------------------- phases


def _arrays(mib: int):
    import numpy as np

    rng = np.random.default_rng(1)
    n = max(1, mib // 64)
    return [rng.standard_normal((4096, 4096), np.float32) for _ in range(n)]  # 64 MiB each


def copy_checksum_phases(mib: int, repeats: int) -> dict:
    """CPU seconds of the copy into pooled buffers and the checksum of every 4 MiB
    chunk: the old way (copy on the copy threads, then crc32c from DRAM on 8 writer
    threads, as ``ChunkWriter`` did) against one pass (``copy_with_crcs`` pieces)."""
    import functools

    from flax_orbax_plugin._base import host as H
    from flax_orbax_plugin._base import host_memory as buffer_pool
    from flax_orbax_plugin._zarr import chunks as C
    from flax_orbax_plugin._zarr import chunks as Z

    arrays = _arrays(mib)
    pool = buffer_pool.BufferPool()
    chunk = (256, 4096)  # 4 MiB of float32
    rows = 4096

    def old():
        later: list = []
        bufs = [pool.copy(a, later) for a in arrays]
        H.copy_all(later)
        t = (time.perf_counter(), _cpu())
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            jobs = [b[i : i + chunk[0]] for b in bufs for i in range(0, rows, chunk[0])]
            list(ex.map(lambda c: Z.crc_trailer([Z.as_bytes(c)]), jobs))
        pool.give_back(bufs)
        return t

    def new(kernel: bool):
        later: list = []
        bufs = []
        for a in arrays:
            out = pool.empty(a.shape, a.dtype)
            bufs.append(out)
            crcs: dict = {}
            step = H.COPY_PIECE // (a.nbytes // rows)
            for i in range(0, rows, step):
                piece = (slice(i, i + step), slice(None))
                copier = functools.partial(
                    C.copy_with_crcs,
                    shape=a.shape,
                    chunk=chunk,
                    index=piece,
                    out=crcs,
                    kernel=kernel,
                )
                later.append((out[i : i + step], a[i : i + step], copier))
        H.copy_all(later)
        pool.give_back(bufs)
        return None

    old()  # the pool's buffers touched once: steady state
    variants = {"copy then crc": old, "one pass (python)": lambda: new(False)}
    if C.has_kernel():
        variants["one pass (kernel)"] = lambda: new(True)
    rows_out: dict[str, list] = {name: [] for name in variants}
    split: list[float] = []
    copy_wall: list[float] = []  # the old way's copy alone: its blocking phase
    with _Machine() as m:
        for _ in range(repeats):
            for name, fn in variants.items():
                w0, c0 = time.perf_counter(), _cpu()
                mid = fn()
                w1, c1 = time.perf_counter(), _cpu()
                rows_out[name].append((c1 - c0, w1 - w0))
                if mid is not None:
                    split.append(c1 - mid[1])
                    copy_wall.append(mid[0] - w0)
    gb = sum(a.nbytes for a in arrays) / 1e9
    out = {
        name: {
            "cpu_s_median": round(statistics.median(c for c, _ in r), 3),
            "cpu_s_per_GB": round(statistics.median(c for c, _ in r) / gb, 3),
            "wall_s_median": round(statistics.median(w for _, w in r), 3),
        }
        for name, r in rows_out.items()
    }
    out["copy then crc"]["of_which_crc_cpu_s_median"] = round(statistics.median(split), 3)
    out["copy then crc"]["of_which_copy_wall_s_median"] = round(statistics.median(copy_wall), 3)
    out["GB"] = round(gb, 3)
    out["crc"] = "crc32c" if Z.GIL_FREE_CRC else "google_crc32c"
    out["kernel_built"] = C.has_kernel()
    out.update(m.figures)
    print("phases", json.dumps(out), flush=True)
    return out


# --------------------------------------------------------------------------- kernel


def kernel_rates(repeats: int, mib: int = 256) -> dict:
    """One thread's GB/s (median of ``repeats``) over ``mib`` MiB, source and
    destination in DRAM: np.copyto, the crc32c package, both, and each way of the
    kernel (``_copycrc.copy_crc``'s ``impl``)."""
    import numpy as np
    from crc32c import crc32c

    from flax_orbax_plugin._zarr import chunks as Z

    src = np.random.default_rng(2).integers(0, 256, mib << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1  # touched: no page faults in the figures

    def two_passes():
        np.copyto(dst, src)
        return crc32c(dst)

    ways = {
        "np.copyto": lambda: np.copyto(dst, src),
        "crc32c package": lambda: crc32c(src),
        "copyto then crc32c": two_passes,
    }
    K = Z._copycrc
    if K is not None:
        if K.HARDWARE:
            ways["kernel sse4.2"] = lambda: K.copy_crc(dst, src, 0, K.SSE42)
            ways["kernel sse4.2 non-temporal"] = lambda: K.copy_crc(dst, src, 0, K.SSE42_NT)
        ways["kernel portable"] = lambda: K.copy_crc(dst, src, 0, K.PORTABLE)
    times: dict[str, list[float]] = {name: [] for name in ways}
    with _Machine() as m:
        for _ in range(repeats):
            for name, fn in ways.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    out: dict = {
        name: {"GBps_median": round(src.nbytes / statistics.median(t) / 1e9, 2)}
        for name, t in times.items()
    }
    out["MiB"] = mib
    out.update(m.figures)
    print("kernel", json.dumps(out), flush=True)
    return out


# ----------------------------------------------------------------------------- save


def steady_saves(mib: int, repeats: int, directory: str) -> dict:
    """A manager's steady saves (version 2, the default) with the one pass off and on
    (``host_snapshot.ONE_PASS``; on: with the kernel, and without it where it is
    built), alternated: wall seconds of the blocking phase and
    process CPU seconds of the whole save (``save`` and ``wait``: copy, checksums,
    writes)."""
    import jax

    import flax_orbax_plugin as fop
    from flax_orbax_plugin._core import host_snapshot as S

    state = {"params": {f"w{i}": jax.numpy.asarray(a) for i, a in enumerate(_arrays(mib))}}
    from flax_orbax_plugin._zarr import chunks as Z

    default, kernel = S.ONE_PASS, Z._copycrc
    ways = [("one pass off", False, kernel), ("one pass on", True, kernel)]
    if kernel is not None:  # and without it: np.copyto, then crc32c, 256 KiB at a time
        ways.append(("one pass on (python)", True, None))
    out: dict[str, list] = {name: [] for name, _, _ in ways}
    with _Machine() as m, fop.CheckpointManager(directory, keep=1) as mngr:
        mngr.save(0, state)  # the pool filled: steady saves from here
        mngr.wait()
        step = 1
        try:
            for _ in range(repeats):
                for name, on, copier in ways:
                    S.ONE_PASS, Z._copycrc = on, copier
                    w0, c0 = time.perf_counter(), _cpu()
                    mngr.save(step, state)
                    blocking = time.perf_counter() - w0
                    mngr.wait()
                    out[name].append((blocking, _cpu() - c0))
                    step += 1
        finally:
            S.ONE_PASS, Z._copycrc = default, kernel
    res: dict = {
        k: {
            "blocking_wall_s_median": round(statistics.median(w for w, _ in v), 3),
            "save_cpu_s_median": round(statistics.median(c for _, c in v), 3),
        }
        for k, v in out.items()
    }
    res["GB"] = round(mib * (1 << 20) / 1e9, 3)
    res["one_pass_default"] = default
    res.update(m.figures)
    print("save", json.dumps(res), flush=True)
    return res


# ---------------------------------------------------------------------------- first


def first_save(mib: int, repeats: int, directory: str) -> dict:
    """The blocking phase (wall and process CPU seconds of ``mngr.save``) of a fresh
    manager's first save against its steady saves, without and with ``reserve`` (its
    own cost reported apart)."""
    import jax

    import flax_orbax_plugin as fop

    state = {"params": {f"w{i}": jax.numpy.asarray(a) for i, a in enumerate(_arrays(mib))}}
    out: dict[str, list] = {"first": [], "first after reserve": [], "steady": [], "reserve": []}
    with _Machine() as m:
        for r in range(repeats):
            for reserve in (False, True):
                path = os.path.join(directory, f"r{r}{int(reserve)}")
                with fop.CheckpointManager(path, keep=1) as mngr:
                    if reserve:
                        w0, c0 = time.perf_counter(), _cpu()
                        mngr.reserve(state)
                        out["reserve"].append((time.perf_counter() - w0, _cpu() - c0))
                    for step in range(3):
                        w0, c0 = time.perf_counter(), _cpu()
                        mngr.save(step, state)
                        figure = (time.perf_counter() - w0, _cpu() - c0)
                        mngr.wait()
                        if step == 0:
                            out["first after reserve" if reserve else "first"].append(figure)
                        elif not reserve:
                            out["steady"].append(figure)
                _rmtree(path)
    res = {
        k: {
            "blocking_wall_s_median": round(statistics.median(w for w, _ in v), 3),
            "blocking_cpu_s_median": round(statistics.median(c for _, c in v), 3),
        }
        for k, v in out.items()
    }
    res["GB"] = round(mib * (1 << 20) / 1e9, 3)
    res.update(m.figures)
    print("first", json.dumps(res), flush=True)
    return res


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    import argparse
    import tempfile

    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--only", default="gil,phases,first,kernel")
    p.add_argument("--out", default="onepass.json")
    a = p.parse_args()
    only = set(a.only.split(","))
    results: dict = {"mib": a.mib, "repeats": a.repeats, "cpus": os.cpu_count()}
    if "gil" in only:
        results["gil"] = gil_stall(a.seconds)  # the writer's 8 threads
        results["gil_1_thread"] = gil_stall(a.seconds, 1)  # a core to spare: the GIL alone
    if "phases" in only:
        results["phases"] = copy_checksum_phases(a.mib, a.repeats)
    if "kernel" in only:
        results["kernel"] = kernel_rates(max(a.repeats, 5))
    if "save" in only:
        with tempfile.TemporaryDirectory(dir=os.environ.get("FOP_BENCH_DIR")) as d:
            results["save"] = steady_saves(a.mib, a.repeats, d)
    if "first" in only:
        with tempfile.TemporaryDirectory(dir=os.environ.get("FOP_BENCH_DIR")) as d:
            results["first"] = first_save(a.mib, a.repeats, d)
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", a.out), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
