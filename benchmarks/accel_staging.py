"""The staging choices of a save's blocking phase, measured on the accelerator at hand.

A training state (``--mib`` MiB in ``--arrays`` float32 arrays) lives on the default
device; a jitted step that donates it runs in a loop (``--k`` sets its matrix work:
about 0.1 s on a TPU v5e at the default). Before one step, each staging choice takes
its snapshot of the state, and a background thread brings the snapshot to host memory
(as a save's background phase does) while ``--follow`` more steps run. Per choice, over
``--repeats`` rounds (the choices rotated each round):

* ``enqueue_s``: the blocking phase (the choice's calls until they return);
* ``next_step_s``: the donating step right after, against ``step_median_s`` (for
  ``async``, from when it could have started: it must wait until the state's own
  arrays are read, or the donation would delete them);
* ``follow_s``: the mean of the ``--follow`` steps after it, while the transfer runs;
* ``host_s``: from the start until every byte is in host memory (the background).

Choices: ``device_get`` (a synchronous reference), ``pinned`` (``device_put`` into
``pinned_host``), ``async`` (``copy_to_host_async`` of the state's own arrays), and
the device-side snapshots followed by a background transfer: ``devcopy`` (a copy per
array), ``devcopy_batched`` (one jitted copy of every array, every transfer started at
once), ``devcopy_seq`` (the batched copy, one array's transfer in flight at a time),
``devcopy_pinned_seq`` (the batched copy, each copy moved into ``pinned_host`` in turn).
Prints one ``STAGING {json}`` line; on CPU it runs at a small size, so that the script
itself is exercised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

CHOICES = "device_get,pinned,async,devcopy,devcopy_batched,devcopy_seq,devcopy_pinned_seq"


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=1536)
    p.add_argument("--arrays", type=int, default=24)
    p.add_argument("--k", type=int, default=2048, help="the step's matrix width")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--follow", type=int, default=8)
    p.add_argument("--choices", default=CHOICES)
    a = p.parse_args(argv)

    dev = jax.devices()[0]
    n = a.mib * 2**20 // 4 // a.arrays
    side = int(n**0.5)
    shape = (side, n // side)
    state = [jnp.full(shape, float(i), jnp.float32) for i in range(a.arrays)]
    w = jnp.ones((shape[1], a.k), jnp.float32) * 1e-4

    def _work(xs):
        return [x + 1e-3 * jnp.tanh((x @ w) @ w.T) for x in xs]

    step = jax.jit(_work, donate_argnums=0)

    def run_step(xs):
        t0 = time.perf_counter()
        xs = step(xs)
        jax.block_until_ready(xs)
        return xs, time.perf_counter() - t0

    batched_copy = jax.jit(lambda xs: [jnp.copy(x) for x in xs])
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")

    def all_at_once(arrays):
        for x in arrays:
            x.copy_to_host_async()
        return [np.asarray(x) for x in arrays]

    def one_at_a_time(arrays):
        return [np.asarray(x) for x in arrays]

    def pinned_in_turn(arrays):
        out = []
        for x in arrays:
            out.append(np.asarray(jax.device_put(x, pinned)))
        return out

    def stage(choice, xs):
        """(what the background brings to host, a function that does it)."""
        if choice == "device_get":
            host = jax.device_get(xs)
            return lambda: host
        if choice == "pinned":
            staged = [jax.device_put(x, pinned) for x in xs]
            return lambda: [np.asarray(s) for s in staged]
        if choice == "async":
            for x in xs:
                x.copy_to_host_async()
            held = list(xs)
            return lambda: [np.asarray(x) for x in held]
        if choice == "devcopy":
            copies = [jnp.copy(x) for x in xs]
            return lambda: all_at_once(copies)
        copies = batched_copy(xs)
        if choice == "devcopy_batched":
            return lambda: all_at_once(copies)
        if choice == "devcopy_seq":
            return lambda: one_at_a_time(copies)
        if choice == "devcopy_pinned_seq":
            return lambda: pinned_in_turn(copies)
        raise ValueError(choice)

    for _ in range(3):  # compile, warm up
        state, _ = run_step(state)
    jax.block_until_ready(batched_copy(state))
    diag = {}
    t0 = time.perf_counter()
    c = batched_copy(state)
    diag["batched_copy_dispatch_s"] = time.perf_counter() - t0
    jax.block_until_ready(c)
    diag["batched_copy_done_s"] = time.perf_counter() - t0
    del c
    t0 = time.perf_counter()
    c = [jnp.copy(x) for x in state]
    diag["per_array_copy_dispatch_s"] = time.perf_counter() - t0
    jax.block_until_ready(c)
    diag["per_array_copy_done_s"] = time.perf_counter() - t0
    del c
    base = []
    for _ in range(5):
        state, t = run_step(state)
        base.append(t)
    choices = a.choices.split(",")
    keys = ("enqueue_s", "next_step_s", "follow_s", "host_s")
    rows: dict[str, dict[str, list]] = {c: {k: [] for k in keys} for c in choices}
    errors = []
    for r in range(a.repeats):
        for c in choices[r % len(choices) :] + choices[: r % len(choices)]:
            try:
                t0 = time.perf_counter()
                fetch = stage(c, state)
                rows[c]["enqueue_s"].append(time.perf_counter() - t0)
                done = {}

                def background(fetch=fetch, t0=t0, done=done):
                    host = fetch()
                    done["t"] = time.perf_counter() - t0
                    done["sum"] = float(sum(float(h.ravel()[0]) for h in host))

                th = threading.Thread(target=background)
                th.start()
                t1 = time.perf_counter()
                if c == "async":
                    th.join()
                state, _ = run_step(state)
                rows[c]["next_step_s"].append(time.perf_counter() - t1)
                follow = []
                for _ in range(a.follow):
                    state, t = run_step(state)
                    follow.append(t)
                rows[c]["follow_s"].append(statistics.mean(follow))
                th.join()
                rows[c]["host_s"].append(done["t"])
                for _ in range(2):  # settle before the next choice
                    state, t = run_step(state)
                    base.append(t)
            except Exception as e:  # noqa: BLE001  (a choice this platform lacks)
                errors.append(f"{c}: {type(e).__name__}: {e}"[:300])
    stats = None
    try:
        stats = {k: v for k, v in (dev.memory_stats() or {}).items() if "bytes" in k}
    except Exception:  # noqa: BLE001
        pass
    out = {
        "platform": dev.platform,
        "device": getattr(dev, "device_kind", str(dev)),
        "state_mib": a.mib,
        "arrays": a.arrays,
        "memories": [m.kind for m in dev.addressable_memories()],
        "memory_stats": stats,
        "step_median_s": statistics.median(base),
        "diagnostics": diag,
        "choices": {
            c: {
                k: {"median": round(statistics.median(v), 4), "all": [round(x, 4) for x in v]}
                for k, v in m.items()
                if v
            }
            for c, m in rows.items()
        },
        "errors": errors,
    }
    print("STAGING " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
