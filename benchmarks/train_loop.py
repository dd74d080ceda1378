"""Training-loop slowdown: total time with background saves vs without (the target),
and the median step time as a second figure.

Run in a fresh process per library (``bench_peers.py`` does that). The state is
workload (a): transformer-shaped float32 params plus Adam moments (~1.2 GB). The
step is a jitted forward/backward over every weight matrix plus ``optax.adam``,
with the state donated (as real loops do), so a library must have copied what it
saves before ``save_async`` returns.

Saves are kept as a loop's retention keeps them (``--keep``, the last 2): besides being
what real loops do, it matters on a VM, where writing into memory the guest never
touched (a page cache that only grows) was measured 10x costlier in system time
than writing into memory freed by deleted files (1.2 GB: 3.0 s against 0.3 s).

Phases, in one process: ``--warmup`` steps (compile), ``keep + 1`` saves that are not
measured (the steady state of a long run: retention deleting, the memory a library
keeps between saves filled), then ``--rounds`` times:
``--steps`` steps without saves, then ``--steps`` steps with an async save at the
start of every ``--every`` steps (the previous one waited for first, as a loop with
one writer does) and a final wait. Medians are over all rounds of each phase.
Prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
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

    step = jax.jit(step, donate_argnums=0)
    return (params, opt_state), step


def as_tree(state):
    """The saved tree: {'params', 'opt_state': {'mu','nu','count'}} like workload (a)."""
    params, opt_state = state
    adam = opt_state[0]
    return {"params": params, "opt_state": {"mu": adam.mu, "nu": adam.nu, "count": adam.count}}


def main(argv=None):
    import jax
    import numpy as np

    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True, help="'none' for the no-save baseline only")
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two phases")
    p.add_argument(
        "--keep",
        type=int,
        default=2,
        help="saves kept, as a loop's retention does (0: all); older ones are deleted "
        "before each save, outside the timed steps (a manager deletes them itself)",
    )
    a = p.parse_args(argv)
    a.dir = os.path.abspath(a.dir)
    C.rmtree(a.dir)
    os.makedirs(a.dir)

    adapter = None
    if a.lib != "none":
        from peers import get_adapter

        adapter = get_adapter(a.lib)
    # A library whose loops save through a manager says so (train_saver); else each
    # save goes to a directory of its own through save_async.
    saver = adapter
    if hasattr(adapter, "train_saver"):
        saver = adapter.train_saver(os.path.join(a.dir, "run"), keep=a.keep)
    state, step = build(C.tree_specs("a"))
    x = jax.device_put(np.random.default_rng(0).random((8, 25600), dtype=np.float32))

    saves = [0]

    def run(n, save_every=0):
        nonlocal state
        times, blocking, pending = [], [], None
        for i in range(n):
            t0 = time.perf_counter()
            if save_every and i % save_every == 0:  # the steps after it overlap the save
                if pending is not None:
                    pending.wait()
                if saver is adapter and a.keep:  # the loop's retention, not timed
                    td = time.perf_counter()
                    C.rmtree(os.path.join(a.dir, f"save_{saves[0] + 1 - a.keep}"))
                    t0 += time.perf_counter() - td
                tb = time.perf_counter()
                saves[0] += 1
                path = os.path.join(a.dir, f"save_{saves[0]}")
                pending = saver.save_async(path, as_tree(state))
                blocking.append(time.perf_counter() - tb)
            state, loss = step(state, x)
            loss.block_until_ready()
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if pending is not None:
            pending.wait()
        return times, blocking, time.perf_counter() - t0

    run(a.warmup)
    if adapter is not None:  # steady state of a long run: retention deleting, caches
        run(a.every * (a.keep + 1), a.every)  # filled; measured from here on
    base, saving, blocking, tail = [], [], [], 0.0
    for _ in range(a.rounds):  # alternate, so drift on a shared machine hits both alike
        base += run(a.steps)[0]
        if adapter is not None:
            s, b, t = run(a.steps, a.every)
            saving += s
            blocking += b
            tail += t
    if saver is not adapter:
        saver.close()
    res = {
        "op": "train",
        "lib": a.lib,
        "steps": a.steps,
        "every": a.every,
        "rounds": a.rounds,
        "base_median_s": statistics.median(base),
        "base_mean_s": statistics.mean(base),
    }
    if adapter is not None:
        res.update(
            save_median_s=statistics.median(saving),
            save_mean_s=statistics.mean(saving),
            final_wait_s=tail,
            blocking_median_s=statistics.median(blocking),
            n_saves=len(blocking),
            slowdown_median=statistics.median(saving) / statistics.median(base),
            # the target: total time of the saving phases (every step, blocking
            # included, plus the final wait) over the same number of steps without
            slowdown_total=(sum(saving) + tail) / sum(base),
            slowdown_mean=(sum(saving) + tail) / sum(base),  # older name, same figure
        )
    C.rmtree(a.dir)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
