"""Where a save's cost to the training loop goes (issue 26, point 1): one process.

1. **The step after a save**, no writer running: the donating step right after
   (a) nothing, (b) zero-copy views of the state were taken and are still held (what
   ``reuse_host_buffers=False`` and ``fop.save_async`` do), (c) the state was copied
   into pooled host buffers (the manager's default). Repeats interleaved; medians.
2. **CPU time of a manager save** of the state, split into the blocking phase and the
   background phase (user and system seconds of the whole process), steady state.
3. **Writing the same bytes as 4 MiB chunk files**, 8 threads, buffered (into the page
   cache, then fsync) against ``O_DIRECT``: wall, user and system seconds.

Writes ``results/train_profile.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import json
import mmap
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402


def _ru():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, time.perf_counter()


def _delta(a, b):
    return {"wall_s": b[2] - a[2], "user_s": b[0] - a[0], "sys_s": b[1] - a[1]}


def step_after(state, step, x, repeats: int) -> dict:
    import jax
    import numpy as np

    from flax_orbax_plugin._base import host as H
    from flax_orbax_plugin._base import host_memory as buffer_pool

    pool = buffer_pool.BufferPool()
    out: dict[str, list[float]] = {"nothing held": [], "views held": [], "pooled copy": []}
    for _ in range(repeats):
        for mode in out:
            leaves = jax.tree_util.tree_leaves(state)
            held = None
            if mode == "views held":
                held = [np.asarray(a) for a in leaves]
            elif mode == "pooled copy":
                later: list = []
                held = [pool.copy(np.asarray(a), later) for a in leaves]
                H.copy_all(later)
                later = None
            del leaves
            t0 = time.perf_counter()
            state, loss = step(state, x)
            loss.block_until_ready()
            out[mode].append(time.perf_counter() - t0)
            if mode == "pooled copy":
                pool.give_back(held)
            held = None
            state, loss = step(state, x)  # back to the steady state
            loss.block_until_ready()
    return {k: statistics.median(v) for k, v in out.items()}, state


def save_cpu(state, repeats: int, directory: str) -> dict:
    import train_loop as T

    import flax_orbax_plugin as fop

    C.rmtree(directory)
    rows = []
    with fop.CheckpointManager(directory, keep=2) as mngr:
        for i in range(repeats + 1):
            a = _ru()
            mngr.save(i, T.as_tree(state))
            b = _ru()
            mngr.wait()
            c = _ru()
            if i:  # the first fills the pool
                rows.append((_delta(a, b), _delta(b, c)))
    C.rmtree(directory)
    return {
        phase: {k: statistics.median(r[j][k] for r in rows) for k in ("wall_s", "user_s", "sys_s")}
        for j, phase in enumerate(("blocking", "background"))
    }


def write_files(nbytes: int, directory: str, repeats: int) -> dict:
    import numpy as np

    from flax_orbax_plugin._zarr import chunks as _crcs

    chunk = 4 << 20
    n = nbytes // chunk
    buf = mmap.mmap(-1, n * chunk)
    arr = np.frombuffer(buf, np.uint8)
    arr[:] = 7

    def one(i, direct):
        part = arr[i * chunk : (i + 1) * chunk]
        ro = part.view()
        ro.flags.writeable = False
        crc = _crcs.extend_crc(0, ro).to_bytes(4, "little")
        path = os.path.join(directory, f"c{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if direct:
                mode = fcntl.fcntl(fd, fcntl.F_GETFL)
                fcntl.fcntl(fd, fcntl.F_SETFL, mode | os.O_DIRECT)
                os.pwrite(fd, memoryview(buf)[i * chunk : (i + 1) * chunk], 0)
                fcntl.fcntl(fd, fcntl.F_SETFL, mode)
                os.pwrite(fd, crc, chunk)
            else:
                os.writev(fd, [memoryview(buf)[i * chunk : (i + 1) * chunk], crc])
            os.fsync(fd)
        finally:
            os.close(fd)

    out: dict[str, list[dict]] = {"buffered": [], "O_DIRECT": []}
    for _ in range(repeats):
        for mode in out:
            C.rmtree(directory)
            os.makedirs(directory)
            os.sync()
            a = _ru()
            with concurrent.futures.ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda i, d=(mode == "O_DIRECT"): one(i, d), range(n)))
            out[mode].append(_delta(a, _ru()))
    C.rmtree(directory)
    return {
        m: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "user_s", "sys_s")}
        for m, rs in out.items()
    }


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(C.TMP, "profile"))
    p.add_argument("--out", default=os.path.join(HERE, "results", "train_profile"))
    a = p.parse_args(argv)
    import jax
    import numpy as np
    import train_loop as T

    loads = [os.getloadavg()[0]]
    state, step = T.build(C.tree_specs("a"))
    x = jax.device_put(np.random.default_rng(0).random((12, 25600), dtype=np.float32))
    for _ in range(3):
        state, loss = step(state, x)
        loss.block_until_ready()
    nbytes = C.total_bytes(C.tree_specs("a"))
    after, state = step_after(state, step, x, a.repeats)
    loads.append(os.getloadavg()[0])
    cpu = save_cpu(state, a.repeats, os.path.join(a.dir, "run"))
    loads.append(os.getloadavg()[0])
    del state
    files = write_files(nbytes, os.path.join(a.dir, "files"), a.repeats)
    loads.append(os.getloadavg()[0])
    res = {"state_mib": nbytes / 2**20, "step_after": after, "save_cpu": cpu, "write": files}
    md = [
        "# Where a save's cost to the training loop goes (issue 26)",
        "",
        f"`python benchmarks/profile_train_save.py --repeats {a.repeats}`: one process, "
        f"workload (a), {nbytes / 2**20:.0f} MiB; medians; load averages "
        f"{min(loads):.1f}-{max(loads):.1f}.",
        "",
        "## The donating step right after a snapshot (no writer running)",
        "",
        "| before the step | step s |",
        "|---|---|",
        *[f"| {k} | {v:.3f} |" for k, v in after.items()],
        "",
        "## CPU time of one manager save (steady state, pooled buffers)",
        "",
        "| phase | wall s | user s | sys s |",
        "|---|---|---|---|",
        *[
            f"| {k} | {v['wall_s']:.3f} | {v['user_s']:.3f} | {v['sys_s']:.3f} |"
            for k, v in cpu.items()
        ],
        "",
        "## The same bytes as 4 MiB files, 8 threads, crc32c and fsync each",
        "",
        "| writes | wall s | user s | sys s |",
        "|---|---|---|---|",
        *[
            f"| {k} | {v['wall_s']:.3f} | {v['user_s']:.3f} | {v['sys_s']:.3f} |"
            for k, v in files.items()
        ],
    ]
    with open(a.out + ".json", "w") as f:
        json.dump({"machine": C.machine_description(), **res}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
