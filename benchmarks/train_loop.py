"""Training-loop cost of checkpointing: the whole run's wall time with saves against
the same run without (issue 26's shape).

One process runs one library once (``bench_train.py`` runs them, each library and the
no-save baseline in a fresh process per repeat, orders alternated). The state is
workload (a): transformer-shaped float32 params plus Adam moments (~1.2 GB). The step
is a jitted forward/backward over every weight matrix plus ``optax.adam`` with the
state donated, as real loops do, so a library must have copied what it saves (or kept
it alive) before ``save_async`` returns.

After ``--warmup`` steps (compile; not timed), ``--steps`` steps are timed as one whole
run: an async save at the start of every ``--every``-th step, the first one included
(the previous save waited for first, as a loop with one writer does), retention keeping
the last ``--keep`` (the library's own manager where it has one, else the loop deletes
the oldest directory, timed), and the final save waited for. Prints ``RESULT {json}``
with the total, every step's time, each save's blocking time and the steps right after
each save.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C


def build(seed_specs):
    import jax
    import jax.numpy as jnp
    import optax

    params = C.build_jax_tree(C.params_specs(seed_specs), "single")
    tx = optax.adam(1e-4)
    opt_state = tx.init(params)

    def loss_fn(p, x):
        total = 0.0
        for leaf in jax.tree_util.tree_leaves(p):
            if leaf.ndim == 2:
                total = total + jnp.mean(jnp.tanh(x[:, : leaf.shape[0]] @ leaf))
            else:
                total = total + 1e-3 * jnp.sum(leaf * leaf)
        return total

    def step(state, x):
        p, o = state
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        upd, o = tx.update(g, o, p)
        return (optax.apply_updates(p, upd), o), loss

    return (params, opt_state), step  # jitted by the caller (donating the state)


def as_tree(state):
    """The saved tree: {'params', 'opt_state': {'mu','nu','count'}} like workload (a)."""
    params, opt_state = state
    adam = opt_state[0]
    return {"params": params, "opt_state": {"mu": adam.mu, "nu": adam.nu, "count": adam.count}}


def _pinned_gbps(tree) -> float | None:
    """GB/s of one copy of ``tree`` into pinned host memory (the host link), or None."""
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    try:
        dev = leaves[0].devices().pop()
        target = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        t0 = time.perf_counter()
        copies = [jax.device_put(x, target) for x in leaves]
        jax.block_until_ready(copies)
        seconds = time.perf_counter() - t0
    except Exception:  # noqa: BLE001  (a platform without pinned_host memory)
        return None
    del copies
    return sum(x.nbytes for x in leaves) / seconds / 1e9


def main(argv=None):
    import jax
    import numpy as np

    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True, help="'none': the run without saves")
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--keep", type=int, default=2, help="saves kept by retention (0: all)")
    p.add_argument("--batch", type=int, default=12, help="rows of the step's input")
    p.add_argument("--saver-options", default="{}", help="JSON options for the library's saver")
    p.add_argument(
        "--cpu-as-device",
        action="store_true",
        help="the plugin treats CPU arrays as accelerator arrays (its GPU path, on CPU)",
    )
    a = p.parse_args(argv)
    if a.cpu_as_device:
        from flax_orbax_plugin._core import device_copy

        device_copy.CPU_AS_DEVICE = True
    a.dir = os.path.abspath(a.dir)
    C.rmtree(a.dir)
    os.makedirs(a.dir)

    adapter = saver = callback = None
    zero_copy = a.lib == "fop-zc"  # the plugin with its zero-copy step (wrap_step)
    if a.lib == "fop-cb":  # the plugin's callback, as a loop adds it
        import flax_orbax_plugin as fop

        options = json.loads(a.saver_options)
        callback = fop.CheckpointCallback(
            os.path.join(a.dir, "run"), every_steps=a.every, keep=a.keep or None, **options
        )
    elif a.lib != "none":
        from peers import get_adapter

        adapter = saver = get_adapter("fop" if zero_copy else a.lib)
        if hasattr(adapter, "train_saver"):  # the library's own manager, with retention
            options = json.loads(a.saver_options)
            saver = adapter.train_saver(os.path.join(a.dir, "run"), keep=a.keep, **options)
    state, step = build(C.tree_specs("a"))
    if zero_copy:  # the state is saved as views; the step after a save takes a spare
        step = saver.manager.wrap_step(step, donate_argnums=0)
    else:
        step = jax.jit(step, donate_argnums=0)
    x = jax.device_put(np.random.default_rng(0).random((a.batch, 25600), dtype=np.float32))
    # The host link, measured before the warm-up: its copy of the state must not meet
    # a zero-copy step's spare (made at its second call) in the peak RSS.
    link_gbps = _pinned_gbps(as_tree(state))
    for _ in range(a.warmup):
        state, loss = step(state, x)
        loss.block_until_ready()

    if hasattr(saver, "reserve") and not zero_copy:  # the pool, before the loop (not timed)
        saver.reserve(as_tree(state))
    if callback is not None:
        callback.on_train_start(as_tree(state))
    times, blocking, after, pending, saves = [], [], [], None, 0
    r_run = resource.getrusage(resource.RUSAGE_SELF)
    t_run = time.perf_counter()
    for i in range(a.steps):
        t0 = time.perf_counter()
        saving = saver is not None and i % a.every == 0
        if callback is not None:  # the callback's own policy: step i + every saves when i does
            tb = time.perf_counter()
            callback.on_step_end(i + a.every, as_tree(state))
            if i % a.every == 0:
                blocking.append(time.perf_counter() - tb)
                saves += 1
        if saving:
            if pending is not None:
                pending.wait()
            if saver is adapter and a.keep and saves >= a.keep:  # the loop's retention
                C.rmtree(os.path.join(a.dir, f"save_{saves - a.keep}"))
            tb = time.perf_counter()
            pending = saver.save_async(os.path.join(a.dir, f"save_{saves}"), as_tree(state))
            blocking.append(time.perf_counter() - tb)
            saves += 1
        state, loss = step(state, x)
        loss.block_until_ready()
        times.append(time.perf_counter() - t0)
        if (saver is not None or callback is not None) and i % a.every == 1:
            after.append(times[-1])
    tw = time.perf_counter()
    if pending is not None:
        pending.wait()
    if callback is not None:
        callback.manager.wait()
    final_wait = time.perf_counter() - tw
    total = time.perf_counter() - t_run
    r_end = resource.getrusage(resource.RUSAGE_SELF)
    if saver is not None and saver is not adapter:
        saver.close()
    if callback is not None:
        callback.manager.close()
    C.rmtree(a.dir)
    res = {
        "op": "train_run",
        "lib": a.lib,
        "options": json.loads(a.saver_options),
        "steps": a.steps,
        "every": a.every,
        "keep": a.keep,
        "total_s": total,
        "cpu_user_s": r_end.ru_utime - r_run.ru_utime,  # every thread of the process
        "cpu_sys_s": r_end.ru_stime - r_run.ru_stime,
        "step_median_s": statistics.median(times),
        "steps_s": times,
        "n_saves": saves,
        "blocking_s": blocking,
        "after_save_s": after,
        "final_wait_s": final_wait,
        "peak_rss_mib": C.peak_rss_bytes() / 2**20,
        "platform": jax.devices()[0].platform,
        "pinned_host_gbps": link_gbps,
        "spare_calls": getattr(step, "spare_calls", None),
    }
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
