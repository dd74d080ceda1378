"""Target functions for tests/_multiprocess.py (run inside each JAX process)."""

from __future__ import annotations

import time


def probe(ctx):
    """Global array across processes, a collective, barrier and key-value store."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n_dev = len(ctx.devices)
    shape = (n_dev * 4, 8)
    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    sharding = NamedSharding(ctx.mesh, P("data"))
    arr = jax.make_array_from_callback(shape, sharding, lambda idx: full[idx])
    total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(ctx.mesh, P()))(arr))
    client = ctx.client
    client.key_value_set(f"probe/{ctx.process_id}", str(ctx.process_id * 10))
    t = time.time()
    client.wait_at_barrier("probe_barrier", 30_000)
    barrier_s = time.time() - t
    others = [client.blocking_key_value_get(f"probe/{p}", 10_000) for p in range(ctx.num_processes)]
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "global_devices": n_dev,
        "local_devices": jax.local_device_count(),
        "addressable_shards": [[s.index[0].start, s.index[0].stop] for s in arr.addressable_shards],
        "is_fully_addressable": arr.is_fully_addressable,
        "sum": total,
        "expected_sum": float(full.sum()),
        "kv": others,
        "barrier_s": barrier_s,
    }


def barrier_after_kill(ctx, timeout_ms=5000, rounds=1):
    """Everyone reaches a barrier; the killed process never does. Reports what survivors see."""
    ctx.client.wait_at_barrier("ready", 30_000)
    ctx.point("before_barrier")
    out = []
    for r in range(rounds):
        t = time.time()
        try:
            ctx.client.wait_at_barrier(f"after_kill_{r}", timeout_ms)
            out.append({"ok": True, "s": time.time() - t})
        except Exception as e:  # noqa: BLE001
            out.append({"ok": False, "s": time.time() - t, "type": type(e).__name__, "msg": str(e)})
        ctx.note("rounds", out)
        ctx.flush()
    return out


def kv_get_after_kill(ctx, timeout_ms=5000):
    ctx.client.wait_at_barrier("ready", 30_000)
    ctx.point("before_get")
    t = time.time()
    try:
        v = ctx.client.blocking_key_value_get("never_set", timeout_ms)
        return {"ok": True, "v": v}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "s": time.time() - t, "type": type(e).__name__, "msg": str(e)}


def sleep_after_kill(ctx, seconds=10):
    """Survivors do nothing with the coordination service for a while: are they killed?"""
    ctx.client.wait_at_barrier("ready", 30_000)
    ctx.point("start")
    t = time.time()
    while time.time() - t < seconds:
        time.sleep(0.1)
        ctx.note("alive_s", time.time() - t)
        ctx.flush()
    return {"slept": time.time() - t}
