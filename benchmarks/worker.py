"""One measured operation in a fresh process; prints ``RESULT {json}`` as its last line.

Started by the drivers through ``common.run_worker``; not meant to be run by hand,
though it can be (``python benchmarks/worker.py save --lib fop --workload b --path X``).

Operations:
  save     build the workload's tree as jax arrays, then an async save:
           blocking = until save_async returns, total = until durable (then one
           fsync pass over what was written, counted alike for every row).
           ``--lib raw`` instead times one host copy of the tree with the plugin's
           allocator (the blocking reference) and writing the same bytes to one
           file by ``--streams`` threads with one fsync; ``--lib raw1`` writes them
           in one sequential stream.
  restore  drop the page cache, then restore the whole tree (``--params``: only the
           params subtree) onto ``--target`` ('single', '4x2', ...); report time,
           peak RSS above the pre-restore RSS, and bytes read from disk; then check
           every leaf's type, shape, dtype and sharding (``--verify``: values too).
  train    see train_loop.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C

RAW = ("raw", "raw1")  # the disk's limit: parallel streams, and one sequential stream


def _leaves(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _tiny_tree():
    """Small, but with the shapes of the measured trees: a leaf stored as its own array
    (2 MiB), small leaves, and params a small part of the small leaves, so the warm-up
    runs the code paths the measured restores run (after drop_caches, code a process
    has not run yet is read from disk and counted in its read bytes)."""
    import jax.numpy as jnp

    return {
        "params": {"w": jnp.arange(16.0).reshape(4, 4), "big": jnp.ones((512, 1024))},
        "x": jnp.ones(8),
        "opt_state": {"mu": jnp.ones(1000), "nu": jnp.ones(1000)},
    }


def _warm_up(adapter, root: str) -> None:
    """One tiny save and restore so one-time setup is not timed."""
    import jax

    path = os.path.join(root, "warmup")
    C.rmtree(path)
    os.makedirs(root, exist_ok=True)
    tree = _tiny_tree()
    adapter.save_async(path, tree).wait()
    like = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    jax.block_until_ready(adapter.restore(path, like))
    jax.block_until_ready(adapter.restore_params(path, like["params"]))
    C.rmtree(path)


def op_save(a) -> dict:
    import numpy as np

    specs = C.tree_specs(a.workload)
    layout = "2x4" if a.workload == "c" else "single"
    C.rmtree(a.path)
    os.makedirs(os.path.dirname(a.path), exist_ok=True)
    adapter = None
    if a.lib not in RAW:
        from peers import get_adapter

        adapter = get_adapter(a.lib)
        _warm_up(adapter, os.path.dirname(a.path))
    tree = C.build_jax_tree(specs, layout)
    nbytes = C.total_bytes(specs)
    os.sync()
    time.sleep(0.2)
    C.reset_peak_rss()
    rss0 = C.rss_bytes()
    io0 = C.io_counters()
    res: dict = {"op": "save", "lib": a.lib, "workload": a.workload, "tree_bytes": nbytes}
    if a.lib in RAW:
        from flax_orbax_plugin._base import host as _host

        # host_copy_s, the blocking reference: one copy of the bytes this process
        # writes (each replica-0 shard), into fresh memory from the allocator the
        # plugin's snapshot uses (aligned, no transparent huge pages), first in the
        # process as a library's snapshot is.
        t0 = time.perf_counter()
        snap = [
            _host.copy(np.asarray(shard.data))
            for _, x in _leaves(tree)
            for shard in x.addressable_shards
            if shard.replica_id == 0
        ]
        t1 = time.perf_counter()
        if a.lib == "raw":
            C.raw_write_parallel(a.path, snap, a.streams)
        else:
            C.raw_write(a.path, snap)
        t2 = time.perf_counter()
        del snap
        res.update(
            host_copy_s=t1 - t0,
            blocking_s=t1 - t0,
            raw_write_s=t2 - t1,
            streams=a.streams if a.lib == "raw" else 1,
        )
        t0 = t1  # the raw save's total is the write, not the copy
    else:
        t0 = time.perf_counter()
        w = adapter.save_async(a.path, tree)
        t1 = time.perf_counter()
        res.update(w.wait() or {})
        t2 = time.perf_counter()
        res.update(blocking_s=t1 - t0, library_total_s=t2 - t0)
    # One fsync pass over everything written, for every row alike, counted in the
    # durable save: it finds nothing dirty where the save was durable on return.
    tf = time.perf_counter()
    C.fsync_tree(a.path)
    tg = time.perf_counter()
    res.update(fsync_pass_s=tg - tf, total_s=tg - t0)
    io1 = C.io_counters()
    res.update(
        peak_rss_delta=C.peak_rss_bytes() - rss0,
        peak_rss_abs=C.peak_rss_bytes(),
        write_bytes=io1["write_bytes"] - io0["write_bytes"],
    )
    res["disk_bytes"], res["disk_alloc_bytes"] = C.disk_usage(a.path)
    if a.lib in RAW:
        # For reference, after the figures above: a copy by numpy's own allocator (huge pages
        # where numpy asks for them), then one into memory the allocator reuses.
        t3 = time.perf_counter()
        snap = [np.array(x, copy=True) for _, x in _leaves(tree)]
        t4 = time.perf_counter()
        del snap
        t5 = time.perf_counter()
        snap = [np.array(x, copy=True) for _, x in _leaves(tree)]
        t6 = time.perf_counter()
        del snap
        res.update(host_copy_numpy_s=t4 - t3, host_copy_warm_s=t6 - t5)
    del tree
    return res


def op_restore(a) -> dict:
    import jax

    specs = C.tree_specs(a.workload)
    if a.params:
        specs = C.params_specs(specs)
    nbytes = C.total_bytes(specs)
    adapter = None
    if a.lib not in RAW:
        from peers import get_adapter

        adapter = get_adapter(a.lib)
        _warm_up(adapter, os.path.join(os.path.dirname(a.path), "warm_r"))
        # target 'numpy': like=None, host numpy arrays (the plugin alone; shows what
        # placing onto devices costs on top of reading)
        like = None if a.target == "numpy" else C.build_like(specs, a.target)
        if a.params and like is not None:
            like = like["params"]
    C.make_cold(a.path)
    time.sleep(0.2)
    C.reset_peak_rss()
    rss0 = C.rss_bytes()
    io0 = C.io_counters()
    t0 = time.perf_counter()
    if a.lib == "raw":  # params come first in the file
        out = C.raw_read_parallel(a.path, a.streams, nbytes if a.params else None)
    elif a.lib == "raw1":
        out = C.raw_read(a.path, nbytes if a.params else None)
    elif a.params:
        out = adapter.restore_params(a.path, like)
        jax.block_until_ready(out)
    elif like is None:
        out = adapter.fop.restore(a.path)
    else:
        out = adapter.restore(a.path, like)
        jax.block_until_ready(out)
    t1 = time.perf_counter()
    io1 = C.io_counters()
    res = {
        "op": "params" if a.params else "restore",
        "lib": a.lib,
        "workload": a.workload,
        "target": a.target,
        "restored_bytes": nbytes,
        "time_s": t1 - t0,
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "peak_rss_delta": C.peak_rss_bytes() - rss0,
        "peak_rss_abs": C.peak_rss_bytes(),
    }
    # Every result, on every repeat: leaf types, shapes, dtypes and placement.
    if a.lib in RAW:
        import numpy as np

        problems = [] if isinstance(out, np.ndarray) and out.nbytes == nbytes else ["size"]
    else:
        problems = C.check_result({"params": out} if a.params else out, specs, a.target)
    res["checks_ok"] = not problems
    if problems:
        res["check_problems"] = problems[:5]
    if a.verify and a.lib not in RAW:  # values too (slow: regenerates every leaf)
        C.verify({"params": out} if a.params else out, specs)
        res["verified"] = True
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("op", choices=["save", "restore"])
    p.add_argument("--lib", required=True)
    p.add_argument("--workload", required=True, choices=list(C.WORKLOADS))
    p.add_argument("--path", required=True)
    p.add_argument("--target", default="single")
    p.add_argument("--params", action="store_true")
    p.add_argument("--verify", action="store_true")
    p.add_argument("--streams", type=int, default=32, help="threads of the parallel raw limit")
    a = p.parse_args(argv)
    a.path = os.path.abspath(a.path)
    load_before = os.getloadavg()[0]
    res = op_save(a) if a.op == "save" else op_restore(a)
    res["loadavg_1m"] = [load_before, os.getloadavg()[0]]  # others' work on a shared machine
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
