"""Copy and checksum in one pass, a GIL-releasing crc32c, the pool reserved before the
loop (issue 34, items 2 and 4).

    python benchmarks/bench_onepass.py [--mib 1200] [--repeats 5] [--only gil,phases,first]

1. **gil**: a "training" thread runs a busy Python loop while 8 threads checksum 4 MiB
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

Load average and /proc/stat steal are recorded beside each figure. Writes
``results/onepass.json``.
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


def gil_stall(seconds: float) -> dict:
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
        with _Machine() as m, concurrent.futures.ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(checksummer) for _ in range(8)]
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
        print(name, json.dumps(out[name]), flush=True)
    return out
