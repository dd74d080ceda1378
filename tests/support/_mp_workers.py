"""Target functions for tests/support/_multiprocess.py (run inside each JAX process)."""

from __future__ import annotations

import json
import os
import time

from _files import flip_byte


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


# ----------------------------------------------------------------- checkpointing workers

ROWS_PER_DEVICE = 128
COLS = 1024  # float32: 512 KiB per device shard of "w"


def expected_w(n_devices_total: int):
    import numpy as np

    rows = ROWS_PER_DEVICE * n_devices_total
    return np.arange(rows * COLS, dtype=np.float32).reshape(rows, COLS) / 7.0


def make_state(ctx, step: int):
    """A sharded training state over the global mesh: w and mu sharded, b replicated."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axis = ctx.mesh.axis_names[0]
    full = expected_w(len(ctx.devices)) + step
    sharded = NamedSharding(ctx.mesh, P(axis))
    replicated = NamedSharding(ctx.mesh, P())
    w = jax.make_array_from_callback(full.shape, sharded, lambda idx: full[idx])
    mu = jax.make_array_from_callback(full.shape, sharded, lambda idx: -full[idx])
    b_host = np.full((COLS,), float(step), np.float32)
    b = jax.make_array_from_callback(b_host.shape, replicated, lambda idx: b_host[idx])
    return {"params": {"w": w, "b": b}, "opt_state": {"mu": mu}}


def shard_bytes_of_this_process(state) -> int:
    """Bytes this process must write: its addressable shards with replica_id == 0."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(state):
        for s in leaf.addressable_shards:
            if s.replica_id == 0:
                total += s.data.nbytes
    return total


def _io_delta(before, after):
    return {k: after[k] - before[k] for k in ("wchar", "write_bytes", "rchar", "read_bytes")}


def _spy_small_files(ctx):
    """Records which small files (metadata, markers, manifests) this process writes."""
    from flax_orbax_plugin._storage import location as _storage

    written = []
    original = _storage.Location.write_bytes

    def spy(self, name, data, **kw):
        written.append(f"{self.path.rstrip('/').rsplit('/', 1)[-1]}/{name}")
        return original(self, name, data, **kw)

    _storage.Location.write_bytes = spy
    return written


def step_path(directory, step):
    """``directory/step`` for a local path, or a kvstore spec dict one level down."""
    if isinstance(directory, dict):
        return {**directory, "path": directory.get("path", "").rstrip("/") + f"/{step}/"}
    return f"{directory}/{step}"


def core_save(
    ctx, directory, steps=(1,), async_save=False, work_between=False, late_s=0.0, format_version=1
):
    """Every process saves the same sharded state with fop.save / fop.save_async.
    ``late_s``: the last process starts each save that much later than the others (the
    others' data lands before it looks at the target)."""
    import jax
    import jax.numpy as jnp

    import flax_orbax_plugin as fop

    small = _spy_small_files(ctx)
    out = {"saves": []}
    handles = []
    for step in steps:
        state = make_state(ctx, step)
        mine = shard_bytes_of_this_process(state)
        before = ctx.io()
        if late_s and ctx.process_id == ctx.num_processes - 1:
            time.sleep(late_s)
        t = time.perf_counter()
        path = step_path(directory, step)
        if async_save:
            handles.append(fop.save_async(path, state, format_version=format_version))
        else:
            fop.save(path, state, format_version=format_version)
        elapsed = time.perf_counter() - t
        if work_between:  # a "train step" that replaces the saved buffers
            state = jax.tree.map(jnp.zeros_like, state)
            jax.block_until_ready(state)
        out["saves"].append(
            {"step": step, "mine": mine, "call_s": elapsed, "io": _io_delta(before, ctx.io())}
        )
    for h in handles:
        h.wait()
    out["small_files"] = small
    out["committed"] = [fop.is_committed(step_path(directory, s)) for s in steps]
    return out


def core_restore(ctx, directory, step=1, mesh_shape=None, spec=("data",)):
    """Restores with fop.restore onto this job's mesh; checks every local shard."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    mesh = ctx.mesh
    if mesh_shape:
        names = tuple(f"m{i}" for i in range(len(mesh_shape)))
        mesh = Mesh(np.array(ctx.devices).reshape(mesh_shape), names)
        spec = tuple(names[i] if isinstance(i, int) else i for i in spec)
    path = f"{directory}/{step}"
    with open(os.path.join(path, "_METADATA.json")) as f:
        rows = _find_rows(json.load(f))
    sharding = NamedSharding(mesh, P(*spec))
    like = {
        "params": {
            "w": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sharding),
            "b": jax.ShapeDtypeStruct((COLS,), np.float32, sharding=NamedSharding(mesh, P())),
        },
        "opt_state": {"mu": jax.ShapeDtypeStruct((rows, COLS), np.float32, sharding=sharding)},
    }

    restore = fop.restore  # the package loads its API on first use: not inside the count
    before, array_before = ctx.io(), _array_bytes_read()
    state = restore(path, like)
    io = _io_delta(before, ctx.io())
    io["array_bytes_read"] = _array_bytes_read() - array_before
    return {"step": step, "rows": rows, **check_state(state, rows, step), "io": io}


def _find_rows(doc) -> int:
    """Rows of leaf 'w' from a metadata document (searched, to not depend on its layout)."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            shape = x.get("shape")
            if isinstance(shape, list) and len(shape) == 2 and shape[1] == COLS:
                found.append(shape[0])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    assert found, doc
    return found[0]


def check_state(state, rows, step) -> dict:
    import numpy as np

    full = expected_w(rows // ROWS_PER_DEVICE) + step
    checked = 0
    for s in state["params"]["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), full[s.index])
        checked += 1
    for s in state["opt_state"]["mu"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), -full[s.index])
    np.testing.assert_array_equal(
        np.asarray(state["params"]["b"].addressable_shards[0].data), np.full(COLS, float(step))
    )
    return {"checked_shards": checked, "sharding": str(state["params"]["w"].sharding.spec)}


def manager_save(
    ctx, directory, steps=(1,), async_save=False, keep=None, work_between=False, late_s=0.0
):
    """Every process saves the same steps through the manager; reports bytes it wrote.
    ``late_s``: the last process starts each save that much later than the others."""
    import jax
    import jax.numpy as jnp

    import flax_orbax_plugin as fop

    out = {"saves": []}
    with fop.CheckpointManager(directory, keep=keep, async_save=async_save) as mngr:
        for step in steps:
            state = make_state(ctx, step)
            mine = shard_bytes_of_this_process(state)
            before = ctx.io()
            if late_s and ctx.process_id == ctx.num_processes - 1:
                time.sleep(late_s)
            t = time.perf_counter()
            mngr.save(step, state, extras={"step": step})
            blocking = time.perf_counter() - t
            if work_between:  # a "train step" that overwrites the saved buffers
                state = jax.tree.map(lambda x: jnp.zeros_like(x), state)
                jax.block_until_ready(state)
            if not async_save:
                mngr.wait()
            out["saves"].append(
                {
                    "step": step,
                    "mine": mine,
                    "blocking_s": blocking,
                    "io": _io_delta(before, ctx.io()),
                }
            )
        t = time.perf_counter()
        mngr.wait()
        out["final_wait_s"] = time.perf_counter() - t
        out["steps"] = mngr.steps()
    return out


def _array_bytes_read() -> int:
    """Bytes of array files this process read: tensorstore's and the chunk reader's."""
    import tensorstore as ts

    from flax_orbax_plugin._zarr import chunk_files as _chunk_files

    found = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v.get("value", 0) for m in found for v in m["values"]) + _chunk_files.bytes_read()


def _kill_mid_write(ctx, after: int) -> None:
    """From now on, the Kill victim dies (ctx.point("mid_save")) when it starts writing
    its ``after + 1``-th array or batch, whichever writer writes it (tensorstore, or
    the direct chunk writer on local disk): some of its chunks are then written or in
    flight, the others not yet."""
    from flax_orbax_plugin._zarr import arrays as _arrays
    from flax_orbax_plugin._zarr import packed_writer as _chunk_writer

    started = {"n": 0}

    def counting(original):
        def wrapper(*args, **kwargs):
            started["n"] += 1
            if started["n"] > after:
                ctx.point("mid_save")
            return original(*args, **kwargs)

        return wrapper

    _arrays.open_for_write = counting(_arrays.open_for_write)
    _chunk_writer.ChunkWriter.array = counting(_chunk_writer.ChunkWriter.array)
    _chunk_writer.ChunkWriter.batch = counting(_chunk_writer.ChunkWriter.batch)


def manager_save_killed(ctx, directory, victim_after_opens=2):
    """Saves step 1 (committed), then step 2; the victim dies mid-write of step 2."""
    import flax_orbax_plugin as fop

    out = {}
    with fop.CheckpointManager(directory) as mngr:
        mngr.save(1, make_state(ctx, 1))
        mngr.wait()
        out["steps_before"] = mngr.steps()
        _kill_mid_write(ctx, victim_after_opens)
        t = time.time()
        ctx.note("t_save2_start", t)
        ctx.flush()
        try:
            mngr.save(2, make_state(ctx, 2))
            mngr.wait()
            out["save2"] = "returned"
        except Exception as e:  # noqa: BLE001
            out["save2"] = f"{type(e).__name__}: {e}"
            out["save2_type"] = type(e).__name__
        out["save2_s"] = time.time() - t
        ctx.note("partial_out", out)
        ctx.flush()
        try:
            mngr.close()
        except Exception as e:  # noqa: BLE001
            out["close"] = f"{type(e).__name__}: {e}"
    return out


def core_save_killed(ctx, directory, victim_after_opens=1):
    """Saves step 1 (committed), then step 2; the Kill victim dies mid-write of step 2.

    The victim SIGKILLs itself when it starts its ``victim_after_opens + 1``-th array
    (see _kill_mid_write).
    """
    import flax_orbax_plugin as fop

    fop.save(f"{directory}/1", make_state(ctx, 1))
    out = {"step1_committed": fop.is_committed(f"{directory}/1")}
    _kill_mid_write(ctx, victim_after_opens)
    state = make_state(ctx, 2)
    t = time.time()
    ctx.note("t_save2_start", t)
    ctx.flush()
    try:
        fop.save(f"{directory}/2", state)
        out["save2"] = "returned"
    except Exception as e:  # noqa: BLE001
        out["save2"] = f"{type(e).__name__}: {e}"
        out["save2_type"] = type(e).__name__
    out["save2_s"] = time.time() - t
    return out


# -- one step, one commit (tests/core/test_commit.py) -------------------------------------------


def replicated_state(ctx, step: int, rows: int = 4096):
    """Pure data parallelism: every leaf replicated on every device of every process."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rep = NamedSharding(ctx.mesh, P())
    host = np.arange(rows * COLS, dtype=np.float32).reshape(rows, COLS) + step
    w = jax.make_array_from_callback(host.shape, rep, lambda idx: host[idx])
    b = jax.make_array_from_callback((COLS,), rep, lambda idx: host[0][idx])
    return {"params": {"w": w, "b": b}, "opt_state": {"count": np.int32(step)}, "step": step}


def commit_counts(ctx, directory, steps=(1, 2, 3), replicated=False):
    """Saves steps through the manager; reports coordination calls and bytes per step."""
    import flax_orbax_plugin as fop
    from flax_orbax_plugin._base import distributed as _distributed

    out = {"per_step": []}
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        for step in steps:
            state = replicated_state(ctx, step) if replicated else make_state(ctx, step)
            before = dict(_distributed.CALLS)
            mngr.save(step, state, extras={"step": step})
            after = dict(_distributed.CALLS)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
            out["per_step"].append({"calls": delta, "written": mngr.last_save.bytes_written})
        out["steps"] = mngr.steps()
    restored = fop.CheckpointManager(directory, read_only=True).restore(
        items="params", step=steps[-1]
    )
    import numpy as np

    step = steps[-1]
    if replicated:
        w = np.arange(4096 * COLS, dtype=np.float32).reshape(4096, COLS) + step
        expect = {"w": w, "b": w[0]}
    else:
        expect = {
            "w": expected_w(len(ctx.devices)) + step,
            "b": np.full((COLS,), float(step), np.float32),
        }
    out["restored_ok"] = all(np.array_equal(restored[k], expect[k]) for k in ("w", "b"))
    return out


def different_steps(ctx, directory):
    """Process i saves step 10 + i: nothing may commit; every process gets an error."""
    import jax

    import flax_orbax_plugin as fop

    with fop.CheckpointManager(directory, async_save=False) as mngr:
        try:
            mngr.save(10 + jax.process_index(), make_state(ctx, 1))
        except fop.CoordinationError as e:
            return {"error": str(e), "steps": mngr.steps()}
    return {"error": None}


def timed_callback(ctx, directory, every_seconds=10.0, n=30):
    """A callback with every_seconds where each process's clock runs at its own speed:
    the manager shares the primary's decision, so every process saves the same steps."""
    import jax

    import flax_orbax_plugin as fop

    speed = 1.0 + 0.7 * jax.process_index()  # process 1's clock runs 1.7x faster
    state = replicated_state(ctx, 0, rows=8)
    cb = fop.CheckpointCallback(directory, every_seconds=every_seconds, keep=None)
    cb.on_train_start(state)
    saved = []
    for step in range(1, n + 1):
        if cb.on_step_end(step, replicated_state(ctx, step, rows=8), t=step * speed):
            saved.append(step)
    cb.on_train_end(replicated_state(ctx, n, rows=8), step=n)
    return {"saved": saved, "steps": fop.CheckpointManager(directory, read_only=True).steps()}


def shared_restore(ctx, directory, share):
    """Saves a replicated state, restores it replicated with share_replicated_reads on
    or off; reports array bytes this process read and whether every shard is right."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    state = replicated_state(ctx, 3)
    path = f"{directory}/c"
    fop.save(path, {"w": state["params"]["w"]})
    rep = NamedSharding(ctx.mesh, P())
    like = {"w": jax.ShapeDtypeStruct(state["params"]["w"].shape, np.float32, sharding=rep)}

    before = _array_bytes_read()
    out = fop.restore(path, like, share_replicated_reads=share)
    read = _array_bytes_read() - before
    expect = np.arange(4096 * COLS, dtype=np.float32).reshape(4096, COLS) + 3
    ok = out["w"].sharding.is_fully_replicated and all(
        np.array_equal(np.asarray(s.data), expect[s.index]) for s in out["w"].addressable_shards
    )
    return {"read": read, "ok": bool(ok), "nbytes": expect.nbytes}


def mixed_state_save(ctx, directory):
    """A mixed state: sharded, replicated, and arrays living on a subset of the
    processes' devices (process 0's first device only, and the last process's)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, SingleDeviceSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    n = len(ctx.devices)
    host = np.arange(n * 8 * 16, dtype=np.float32).reshape(n * 8, 16)
    sharded = jax.make_array_from_callback(
        host.shape, NamedSharding(ctx.mesh, P("data")), lambda i: host[i]
    )
    rep = jax.make_array_from_callback((16,), NamedSharding(ctx.mesh, P()), lambda i: host[0][i])
    first, last = ctx.devices[0], ctx.devices[-1]
    big = np.arange(600 * 1000, dtype=np.float32).reshape(600, 1000)  # its own array
    on_first = jax.make_array_from_callback(
        big.shape, SingleDeviceSharding(first), lambda i: big[i], dtype=np.float32
    )
    on_last = jax.make_array_from_callback(
        (5,),
        SingleDeviceSharding(last),
        lambda i: np.arange(5.0, dtype=np.float32)[i],
        dtype=np.float32,
    )
    state = {"params": {"s": sharded, "r": rep, "first": on_first, "last": on_last}}
    with fop.CheckpointManager(directory, async_save=False) as m:
        m.save(1, state)
        steps = m.steps()
    out = fop.CheckpointManager(directory, read_only=True).restore(items="params")
    ok = (
        np.array_equal(out["s"], host)
        and np.array_equal(out["r"], host[0])
        and np.array_equal(out["first"], big)
        and np.array_equal(out["last"], np.arange(5.0, dtype=np.float32))
    )
    return {"steps": steps, "ok": bool(ok)}


def iterator_into_more_processes(ctx, directory):
    """Restores, with this job's process count, a step whose data iterator was saved by
    one process: the iterator is refused naming both counts; params restore."""
    import flax_orbax_plugin as fop

    mngr = fop.CheckpointManager(directory, read_only=True)
    try:
        mngr.restore(items="data_iterator")
        error = None
    except fop.StructureError as e:
        error = str(e)
    params = mngr.restore(items="params")
    return {"error": error, "w": [float(x) for x in params["w"]]}


# ------------------------------------------------------------------ preemption (issue 23)

PREEMPT_ROWS = 8  # rows of "w" per device
PREEMPT_COLS = 16


def preempt_expected(step: int, n_devices: int) -> dict:
    """The state ``preempted_training`` holds after ``step`` steps (exact: int32 sums)."""
    import numpy as np

    w = np.arange(PREEMPT_ROWS * n_devices * PREEMPT_COLS, dtype=np.int64)
    w = w.reshape(PREEMPT_ROWS * n_devices, PREEMPT_COLS)
    for _ in range(step):
        w = w + (int(w.sum()) % 97) + 1
    return {"w": w.astype(np.int32), "b": np.int32(step)}


def _progress_path(workdir: str, process: int) -> str:
    return os.path.join(workdir, f"progress_{process}")


def progress(workdir: str, process: int) -> int:
    """The last step ``process`` finished (-1 before its first), for the parent."""
    try:
        with open(_progress_path(workdir, process), "rb") as f:
            lines = f.read().split()
    except FileNotFoundError:
        return -1
    return int(lines[-1]) if lines else -1


def preempted_training(
    ctx,
    directory,
    via="manager",
    steps=300,
    every_steps=5,
    step_s=0.1,
    resume=False,
    persistent=None,
):
    """A training loop (a cross-process all-reduce per step) saving every ``every_steps``
    with ``handle_sigterm=True``, through the manager or the callback; each finished step
    is appended to ``progress_<process>`` so the parent can signal at a chosen step.
    Leaves with the manager's SystemExit(143) once preempted (``last_step``: the step
    whose save raised it). With ``resume``: checks the restored shards bit-exact. With
    ``persistent`` (manager only): each process on its own ``directory/host<i>``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    n_dev = len(ctx.devices)
    sharded = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    replicated = NamedSharding(ctx.mesh, P())

    def state_of(host: dict) -> dict:
        w = jax.make_array_from_callback(host["w"].shape, sharded, lambda i: host["w"][i])
        b = jax.make_array_from_callback((), replicated, lambda i: np.asarray(host["b"]))
        return {"params": {"w": w, "b": b}}

    train = jax.jit(
        lambda s: {
            "params": {
                "w": s["params"]["w"] + (jnp.sum(s["params"]["w"]) % 97) + 1,
                "b": s["params"]["b"] + 1,
            }
        },
        out_shardings={"params": {"w": sharded, "b": replicated}},
    )
    state = state_of(preempt_expected(0, n_dev))
    if via == "manager":
        if persistent is not None:
            directory = os.path.join(directory, f"host{ctx.process_id}")
        mngr = fop.CheckpointManager(
            directory, every_steps=every_steps, keep=2, handle_sigterm=True, persistent=persistent
        )
        if resume:
            state = mngr.restore(like=state)
        start = (mngr.restored_step or 0) + 1 if resume else 1
        save = lambda step, s: mngr.save(step, s)
    else:
        cb = fop.CheckpointCallback(
            directory,
            every_steps=every_steps,
            keep=2,
            resume=resume,
            manager_options={"handle_sigterm": True},
        )
        state = cb.on_train_start(state)
        mngr = cb.manager
        start = (cb.resumed_step or 0) + 1
        save = lambda step, s: cb.on_step_end(step, s)
    ctx.note("mode", mngr._schedule.preemption.mode)
    if resume:
        want = preempt_expected(start - 1, n_dev)
        exact = all(
            np.array_equal(np.asarray(sh.data), want["w"][sh.index])
            for sh in state["params"]["w"].addressable_shards
        ) and int(state["params"]["b"]) == int(want["b"])
        ctx.note("resumed", start - 1)
        ctx.note("resumed_exact", bool(exact))
    with open(_progress_path(ctx.workdir, ctx.process_id), "a") as log:
        for step in range(start, steps + 1):
            state = train(state)
            jax.block_until_ready(state)
            log.write(f"{step}\n")
            log.flush()
            ctx.note("last_step", step)
            save(step, state)
            time.sleep(step_s)
    if via == "manager":
        mngr.close()
    else:
        cb.on_train_end(state)
    return {"preempted": False, "last_step": steps}


def sigterm_without_preemption_service(ctx, directory):
    """handle_sigterm=True when jax's preemption service is off: refused at open."""
    import flax_orbax_plugin as fop

    try:
        fop.CheckpointManager(directory, handle_sigterm=True).close()
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


def callback_step_times(ctx, directory, steps=31, every_steps=5, step_s=0.05, rows=2048):
    """Step times of a loop with an async callback (a 2048-row float32 sharded state per
    device, 8 MiB): whether the step after a save waits for the save's commit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    sharded = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    shape = (rows * len(ctx.devices), 1024)
    w = jax.make_array_from_callback(shape, sharded, lambda i: np.ones(shape, np.float32)[i])
    train = jax.jit(lambda w: w + jnp.mean(w) * 1e-6, out_shardings=sharded)
    from flax_orbax_plugin._base import distributed as _distributed

    cb = fop.CheckpointCallback(directory, every_steps=every_steps, keep=2)
    cb.on_train_start({"params": {"w": w}})
    times, saved, barriers = [], [], []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        w = train(w)
        jax.block_until_ready(w)
        time.sleep(step_s)
        before = _distributed.CALLS["barrier"]
        if cb.on_step_end(step, {"params": {"w": w}}):
            saved.append(step)
        barriers.append(_distributed.CALLS["barrier"] - before)
        times.append(time.perf_counter() - t)
    cb.on_train_end({"params": {"w": w}})
    return {
        "times": times,
        "saved": saved,
        "barriers": barriers,  # per on_step_end
        "reported": [h.step for h in cb.history],
        "totals": [h.total_seconds for h in cb.history],
    }


def per_host_directories(ctx, base, shared=False):
    """A writer opened by every process on a local path: its own directory per process
    (hosts without a shared disk), or one shared. Reports the error and what is left."""
    import flax_orbax_plugin as fop

    directory = base if shared else os.path.join(base, f"host{ctx.process_id}")
    try:
        fop.CheckpointManager(directory).close()
        error = None
    except fop.CheckpointError as e:
        error = str(e)
    left = sorted(os.listdir(directory)) if os.path.isdir(directory) else None
    return {"error": error, "left": left}


def steps_held(arrays: dict, full_of, steps=(1, 2)) -> list[int]:
    """The steps (of ``steps``) whose values every local shard of ``arrays`` holds;
    ``full_of(step)``: each name's whole array at that step."""
    import numpy as np

    held = []
    for step in steps:
        want = full_of(step)
        if all(
            np.array_equal(np.asarray(s.data), want[name][s.index])
            for name, arr in arrays.items()
            for s in arr.addressable_shards
        ):
            held.append(step)
    return held


def _damage_last_chunk(step_dir: str, shape: list[int]) -> str:
    """Flips a byte in the last chunk file of the array of ``shape`` under ``step_dir``
    (a row block that only the last process reads); returns the file's path."""
    import glob
    import json

    for meta in glob.glob(f"{step_dir}/**/zarr.json", recursive=True):
        with open(meta) as f:
            if json.load(f).get("shape") == shape:
                chunks = sorted(glob.glob(f"{os.path.dirname(meta)}/c/**", recursive=True))
                victim = [c for c in chunks if os.path.isfile(c)][-1]
                flip_byte(victim)
                return victim
    raise AssertionError(f"no array of shape {shape} under {step_dir}")


def damaged_where_one_process_reads(ctx, directory, leaf):
    """Steps 1 and 2 through the manager; the primary damages a chunk of step 2's
    ``leaf`` ("w": sharded by rows; "r": replicated) that only the last process reads.
    Then ``fop.restore`` of step 2 with both leaves sharded by rows, and the manager's
    restore of the latest (``r`` replicated again: read shared, each process reads its
    rows and the parts are all-gathered), on every process."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    rows = 4096 * ctx.num_processes
    axis = ctx.mesh.axis_names[0]

    def full(step):
        w = np.arange(rows * 256, dtype=np.float32).reshape(rows, 256) + step
        r = np.arange(rows * 512, dtype=np.float32).reshape(rows, 512) - step
        return {"w": w, "r": r}

    def state(step):
        put = lambda x, spec: jax.make_array_from_callback(
            x.shape, NamedSharding(ctx.mesh, spec), lambda i: x[i]
        )
        host = full(step)
        return {"params": {"w": put(host["w"], P(axis)), "r": put(host["r"], P())}}

    out = {}
    with fop.CheckpointManager(directory, format_version=1) as mngr:  # a chunk file damaged
        for step in (1, 2):
            mngr.save(step, state(step))
        mngr.wait()
    ctx.client.wait_at_barrier("fop_test/saved", 60_000)
    if ctx.process_id == 0:
        shape = [rows, 256] if leaf == "w" else [rows, 512]
        out["victim"] = _damage_last_chunk(os.path.join(directory, "2"), shape)
    ctx.client.wait_at_barrier("fop_test/damaged", 60_000)
    # The core restore places both leaves by rows over the processes (no shared read):
    # the one whose rows hold the damage fails, and so must every other.
    rows_like = {
        name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(ctx.mesh, P(axis)))
        for name, a in state(0)["params"].items()
    }
    t = time.perf_counter()
    try:
        fop.restore(os.path.join(directory, "2", "params"), rows_like)
        out["core"] = "returned"
    except fop.CheckpointError as e:
        out["core"] = f"{type(e).__name__}: {e}"
    out["core_s"] = time.perf_counter() - t
    with fop.CheckpointManager(directory) as mngr:
        restored = mngr.restore(like=state(0))
        out["restored_step"] = mngr.restored_step
        out["values_of_step"] = steps_held(restored["params"], full)
        out["steps_after"] = mngr.steps()
    return out


def primary_restores_alone(ctx, directory):
    """Every process saves; then the primary alone restores it as host arrays (no
    like: nothing shared, so nothing collective), while the others wait at a barrier."""
    import flax_orbax_plugin as fop

    path = os.path.join(directory, "1")
    fop.save(path, make_state(ctx, 1))
    out = {}
    if ctx.process_id == 0:
        t = time.perf_counter()
        host = fop.restore(path)
        out["restore_s"] = time.perf_counter() - t
        out["w_ok"] = bool((host["params"]["w"] == expected_w(len(ctx.devices)) + 1).all())
    ctx.client.wait_at_barrier("fop_test/read-alone", 60_000)
    return out


def serving_while_a_step_lands(ctx, directory):
    """Steps 1 and 2 through the manager; step 2 is then hidden and put back by the
    primary while the last process already lists the directory: both call
    ``restore_params`` with a sharded ``like`` (a collective read). Reports the step
    whose values this process's shards hold."""
    import jax

    import flax_orbax_plugin as fop

    with fop.CheckpointManager(directory) as mngr:
        for step in (1, 2):
            mngr.save(step, make_state(ctx, step))
    hidden = os.path.join(directory, "hidden-2")
    if ctx.process_id == 0:
        os.rename(os.path.join(directory, "2"), hidden)
    ctx.client.wait_at_barrier("fop_test/hidden", 60_000)
    if ctx.process_id == 0:
        time.sleep(1.5)  # the other process lists now, seeing step 1 only
        os.rename(hidden, os.path.join(directory, "2"))
    like = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        make_state(ctx, 0)["params"],
    )
    params = fop.restore_params(directory, like)
    full = expected_w(len(ctx.devices))
    return {"held": steps_held({"w": params["w"]}, lambda step: {"w": full + step})}


def callback_overwrite(ctx, directory):
    """Steps 1 and 2 saved, then a callback with resume=False, overwrite=True on every
    process: the manager's collective delete removes them (the primary removes, all
    meet); reports the steps each process then lists."""
    import flax_orbax_plugin as fop

    with fop.CheckpointManager(directory) as mngr:
        for step in (1, 2):
            mngr.save(step, replicated_state(ctx, step, rows=64))
    cb = fop.CheckpointCallback(directory, resume=False, overwrite=True)
    assert cb.manager.latest_step() == 2  # opened (collectively); process 1 then lists late
    if ctx.process_id == 1:
        time.sleep(1.0)
    cb.on_train_start(replicated_state(ctx, 0, rows=64))
    steps = cb.manager.steps()
    cb.on_train_end(replicated_state(ctx, 3, rows=64), step=3)
    return {
        "after_clear": steps,
        "at_end": fop.CheckpointManager(directory, read_only=True).steps(),
    }


def restores_that_differ(ctx, directory, differ):
    """Steps 1 and 2 through the manager, then a collective restore that differs on the
    last process only (``differ``: "step", its step; "dtype", its like's dtype of ``w``;
    "spec", its like's sharding of ``w``). Reports what the restore raised."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    with fop.CheckpointManager(directory) as mngr:
        for step in (1, 2):
            mngr.save(step, make_state(ctx, step))
    last = ctx.process_id == ctx.num_processes - 1
    like = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        make_state(ctx, 0)["params"],
    )
    w = like["w"]
    if last and differ == "dtype":
        like["w"] = jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=w.sharding)
    if last and differ == "spec":
        like["w"] = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(ctx.mesh, P()))
    step = 1 if last and differ == "step" else 2
    started = time.monotonic()
    try:
        fop.restore_params(directory, like, step=step)
    except fop.CoordinationError as e:
        return {"raised": str(e), "after_s": time.monotonic() - started}
    return {"raised": None}


def host_leaf_that_differs(ctx, directory):
    """``fop.save`` of a tree whose Python float ``lr`` differs on the last process
    (process 0's was saved for all, silently). Reports what the save raised."""
    import flax_orbax_plugin as fop

    state = make_state(ctx, 1)
    state["params"]["lr"] = 0.2 if ctx.process_id == ctx.num_processes - 1 else 0.1
    try:
        fop.save(directory, state)
    except fop.CoordinationError as e:
        return {"raised": str(e)}
    return {"raised": None}


def serving_onto_an_abstract_mesh(ctx, directory):
    """restore_params with a like on the global mesh's AbstractMesh (nnx.eval_shape under
    jax.set_mesh gives these), inside jax.set_mesh: a collective read onto that mesh.
    Reports the step whose values this process's shards hold."""
    import jax
    from jax.sharding import NamedSharding

    import flax_orbax_plugin as fop

    with fop.CheckpointManager(directory) as mngr:
        mngr.save(1, make_state(ctx, 1))
    abstract = ctx.mesh.abstract_mesh
    like = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(abstract, a.sharding.spec)
        ),
        make_state(ctx, 0)["params"],
    )
    with jax.set_mesh(ctx.mesh):
        params = fop.restore_params(directory, like)
    full = expected_w(len(ctx.devices))
    return {"held": steps_held({"w": params["w"]}, lambda step: {"w": full + step})}


def _small_sharded(ctx, step: int = 0):
    """{"params": {"w": 8 x 4 float32 sharded over every device of every process}}."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    full = np.arange(8 * 4, dtype=np.float32).reshape(8, 4) + step
    sharding = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    return {"params": {"w": jax.make_array_from_callback(full.shape, sharding, lambda i: full[i])}}


def _timed(out: dict, name: str, call) -> None:
    """Runs ``call()``; records under ``name`` its error (or None) and how long it took."""
    t = time.monotonic()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001  (reported to the test)
        error = f"{type(e).__name__}: {e}"
    out[name] = {"error": error, "s": time.monotonic() - t}


def refused_on_one_process(ctx, directory):
    """Process 1 alone makes each call with a bad argument and catches its error (as a
    program that goes on would); process 0 makes it correctly. Each call's error and
    duration, by scenario; the processes stay in step (each refusal is one operation)."""
    import flax_orbax_plugin as fop

    bad = ctx.process_id == 1
    odd = {"bogus": 1} if bad else {}
    state = _small_sharded(ctx)
    core = os.path.join(directory, "core")
    out: dict = {}
    _timed(out, "save", lambda: fop.save(f"{core}-a", state, **odd))
    _timed(out, "save_async", lambda: fop.save_async(f"{core}-b", state, **odd).wait())
    fop.save(f"{core}-c", state)
    _timed(out, "restore", lambda: fop.restore(f"{core}-c", like=state, **odd))
    run = os.path.join(directory, "run")
    with fop.CheckpointManager(run, async_save=False) as mngr:
        _timed(out, "manager.save", lambda: mngr.save(1, state, **odd))
        mngr.save(2, state)
    _timed(out, "restore_params", lambda: fop.restore_params(run, like=state, **odd))

    def callback():
        cb = fop.CheckpointCallback(os.path.join(directory, "cb"), keep="x" if bad else 2)
        cb.on_train_start(state)
        cb.on_train_end(state, step=1)

    _timed(out, "callback", callback)
    return out


def error_met_at_different_steps(ctx, directory):
    """Process 1's first save fails after process 0 committed it (at its read of the
    commit's outcome: ``FOP_FAIL_AT``): process 1 closes, process 0 saves the next step,
    then closes. Each one's save error, close error and their times."""
    import flax_orbax_plugin as fop

    if ctx.process_id == 1:
        os.environ["FOP_FAIL_AT"] = "collective-manager-save:2"  # step 1's outcome read
    out: dict = {}
    mngr = fop.CheckpointManager(directory, async_save=False)
    for step in (1, 2):
        _timed(out, f"save {step}", lambda s=step: mngr.save(s, _small_sharded(ctx, s)))
        if out[f"save {step}"]["error"] is not None:
            break
    os.environ.pop("FOP_FAIL_AT", None)
    _timed(out, "close", mngr.close)
    return out


def device_staging_across_processes(ctx, directory):
    """A manager save through the accelerator's device staging (``CPU_AS_DEVICE``) where
    process 1's devices are full (it falls back to host staging) and process 0's are
    not: no collective in either staging, so neither waits for the other; then each
    process's shards are restored and compared."""
    import jax
    import numpy as np

    import flax_orbax_plugin as fop
    from flax_orbax_plugin._core import device_copy

    device_copy.CPU_AS_DEVICE = True
    if ctx.process_id == 1:
        device_copy.free_bytes = lambda device: 0
    state = make_state(ctx, 3)
    expected = {
        path: [np.asarray(s.data) for s in x.addressable_shards]
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    like = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    events = []
    with fop.CheckpointManager(directory, on_event=events.append) as mngr:
        mngr.save(3, state)
        state = jax.tree.map(lambda a: a * 0 - 1, state)  # the loop goes on
        mngr.wait()
        got = mngr.restore(step=3, like=like)
    exact = all(
        all(
            np.array_equal(np.asarray(s.data), e)
            for s, e in zip(x.addressable_shards, expected[p], strict=True)
        )
        for p, x in jax.tree_util.tree_flatten_with_path(got)[0]
    )
    staging = [e.staging for e in events if type(e).__name__ == "SaveBlockingDone"]
    return {"staging": staging, "exact": exact}
