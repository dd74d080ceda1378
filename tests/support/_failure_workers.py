"""Workers for one process failing inside each collective operation (run by
tests/support/_multiprocess.py in every JAX process; the test is
tests/end_to_end/test_distributed.py, the benchmark benchmarks/bench_failure_propagation.py).

:func:`one_fails_in_each` runs operations in order, in one launch; in each one process
(the victim) fails and every process must raise. The victim fails through a fault point
(``FOP_FAIL_AT``, set on the victim alone around the operation): ``collective-<kind>``
raises before its first coordination call in that kind of operation (``_base.regions``),
so the others are already waiting for it; two operations fail on a real bad input of the
victim's instead (a state that does not fit, a ``like`` of the wrong shape). Between
operations the processes meet at a barrier of their own, so each operation starts
together and its time counts from there.
"""

from __future__ import annotations

import contextlib
import os
import time

from _mp_workers import make_state, step_path

# name -> the fault the victim gets (None: a real bad input, see _operation)
FAULTS = {
    "manager-open": "collective-manager-open:1",
    "manager-save": "collective-manager-save:1",
    "manager-save-bad-state": None,
    "manager-restore": "collective-manager-restore:1",
    "manager-restore-bad-like": None,
    "manager-wait": "collective-manager-wait:1",
    "save": "collective-save:1",
    "save_async": "collective-save:1",
    "restore": "collective-restore:1",
    "restore_params": "collective-restore-params:1",
    "tier-rounds": "collective-tier-rounds:1",
}


@contextlib.contextmanager
def _fault(spec: str | None, mine: bool):
    if spec is None or not mine:
        yield
        return
    os.environ["FOP_FAIL_AT"] = spec
    try:
        yield
    finally:
        del os.environ["FOP_FAIL_AT"]


def _like(ctx, tree):
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _operation(ctx, name: str, directory: str, victim: bool):
    """Prepares operation ``name`` (every process, succeeding) and returns the call
    that must fail on every process, and what to run after it (every process)."""
    import jax

    import flax_orbax_plugin as fop

    d = step_path(directory, name)  # a local path, or a kvstore spec one level down
    state = make_state(ctx, 1)
    if name == "manager-open":
        return lambda: fop.CheckpointManager(d, async_save=False).close(), None
    if name in ("save", "save_async"):
        if name == "save":
            return lambda: fop.save(step_path(d, 1), state), None
        return lambda: fop.save_async(step_path(d, 1), state).wait(), None
    params_like = _like(ctx, state["params"])
    if name == "restore":
        fop.save(step_path(d, 1), state["params"])
        return lambda: fop.restore(step_path(d, 1), params_like), None
    if name == "restore_params":
        with fop.CheckpointManager(d) as mngr:
            mngr.save(1, state)
        return lambda: fop.restore_params(d, params_like), None
    if name == "tier-rounds":  # the replication of step 1 to a persistent tier
        return lambda: _replicate(d, state), None
    mngr = fop.CheckpointManager(d, async_save=False, keep=1)
    if name == "manager-save":
        return lambda: mngr.save(1, state), mngr.close
    if name == "manager-save-bad-state":  # the victim's state holds a leaf it cannot save
        bad = {**state, "opt_state": {**state["opt_state"], "o": object()}} if victim else state
        return lambda: mngr.save(1, bad), mngr.close
    mngr.save(1, state)
    if name == "manager-restore":
        return lambda: mngr.restore(like=_like(ctx, state)), mngr.close
    if name == "manager-restore-bad-like":  # the victim's like has the wrong shape
        like = _like(ctx, state)
        if victim:
            w = like["params"]["w"]
            like["params"]["w"] = jax.ShapeDtypeStruct((w.shape[0], 7), w.dtype, sharding=None)
        return lambda: mngr.restore(like=like), mngr.close
    if name == "manager-wait":  # retention of step 1 after step 2, then the meeting
        mngr.save(2, make_state(ctx, 2))
        return mngr.wait, mngr.close
    raise ValueError(name)


def _replicate(d: str, state) -> None:
    import flax_orbax_plugin as fop

    mngr = fop.CheckpointManager(
        os.path.join(d, "local"), persistent=os.path.join(d, "remote"), async_save=False
    )
    try:
        mngr.save(1, state)
        mngr.persistent.wait()
    finally:
        mngr.close()  # raises the replication's error too (where wait did not yet)


def one_fails_in_each(ctx, directory, names, victim=1):
    """Runs each operation of ``names`` with process ``victim`` failing in it; returns,
    per operation and for this process, the error raised (or "returned") and when."""
    import flax_orbax_plugin as fop

    me_victim = ctx.process_id == victim
    out = []
    for i, name in enumerate(names):
        call, after = _operation(ctx, name, step_path(directory, i), me_victim)
        ctx.client.wait_at_barrier(f"fop_failure/{i}", 60_000)
        t0 = time.time()
        error = "returned"
        with _fault(FAULTS[name], me_victim):
            try:
                call()
            except Exception as e:  # noqa: BLE001  (what every process raised is the result)
                error = f"{type(e).__name__}: {e}"
        t_raised = time.time()
        if after is not None:
            try:
                after()
            except fop.CheckpointError:
                pass  # a manager whose save failed re-raises it on close: seen above
        out.append({"name": name, "error": error, "t0": t0, "t_raised": t_raised})
        ctx.note("done", out)  # kept if a later operation hangs
        ctx.flush()
    return out
