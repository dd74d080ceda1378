"""Walks through the package, measured: which modules a call enters, and calls that go up.

    python tools/walks.py

Runs six operations on small trees (CPU, a temporary directory) under a profiler
that sees every Python call in every thread, and reports for each:

- the package modules entered from another package module, with the number of
  such entries (a module entered many times is a walk that keeps coming back);
- the calls from a wing into a wing ranked above it ("up a layer"), by caller and
  callee function, with counts.

The operations (each run once to warm up, then walked): ``save``, ``fop.save`` of a
small tree; ``restore``, ``fop.restore`` of it; ``manager``, an async
``CheckpointManager.save`` and its wait; ``serve``, ``restore_params``;
``callback``, a ``CheckpointCallback.on_step_end`` that saves (and its wait);
``reuse``, an incremental manager save with nothing changed (warmed by two saves:
the first incremental save has no step to reuse from, so the second is the first
that reuses, and it says once per run which leaves reuse never takes). Then the hidden modes
of ``tools/state_scan.py`` (context variables, module-level mutable state, format
version tests outside the seam) and a summary table. Works on the flat layout of
before the wings as well (``FLAT_WINGS`` maps its modules to the wings they moved
to). Single-threaded driver; not a test.
"""

from __future__ import annotations

import collections
import importlib.util
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from import_graph import WINGS
from state_scan import report

# Where each module of the flat layout (before the wings) went.
FLAT_WINGS = {
    **dict.fromkeys(["_tree", "_host", "_faults", "_distributed"], "_base"),
    **dict.fromkeys(["_storage", "_lock", "_server_copy", "_shared_dir", "_run_owner"], "_storage"),
    **dict.fromkeys(["_layout", "_steps", "_metadata"], "_format"),
    **dict.fromkeys(["_chunk_files", "_arrays"], "_zarr"),
    **dict.fromkeys(["_casting", "_onto_like", "_transform"], "_like"),
    **dict.fromkeys(["_train_state", "_resume", "_iterators"], "_state"),
    "_incremental": "_incremental",
    **dict.fromkeys(["_save", "_restore", "_commit", "_ownership", "_verify"], "_core"),
    **dict.fromkeys(
        [
            "_manager",
            "_policy",
            "_retention",
            "_checkpointables",
            "_tiers",
            "_callback",
            "_preemption",
            "_options",
        ],
        "_manager",
    ),
    **dict.fromkeys(["_orbax_import", "_msgpack_import", "_safetensors", "_importing"], "_interop"),
    "_serving": "_reading",
    "cli": "cli",
    "_errors": "_errors",
}
RANK = {w: i for i, w in enumerate(WINGS)}
TOP = "flax_orbax_plugin"


def _wing(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != TOP:
        return None
    return FLAT_WINGS.get(parts[1], parts[1])


class _Tracer:
    def __init__(self):
        self.entered: collections.Counter = collections.Counter()
        self.up: collections.Counter = collections.Counter()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith(TOP + "."):
            return
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        if not caller.startswith(TOP + ".") or caller == callee:
            return
        self.entered[callee] += 1
        wc, we = _wing(caller), _wing(callee)
        if wc in RANK and we in RANK and RANK[we] > RANK[wc]:
            name = f"{caller}:{back.f_code.co_name} -> {callee}:{frame.f_code.co_name}"
            self.up[name] += 1

    def run(self, fn):
        sys.setprofile(self)
        threading.setprofile(self)
        try:
            return fn()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


def _lines(modules) -> int:
    """The lines the files of ``modules`` hold: what a reader of the walk reads."""
    total = 0
    for module in modules:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            total += len(Path(spec.origin).read_text().splitlines())
    return total


def _report(title: str, tracer: _Tracer) -> None:
    short = lambda m: m[len(TOP) + 1 :]
    print(f"== {title}")
    print(f"modules entered: {len(tracer.entered)}, holding {_lines(tracer.entered)} lines")
    for module, n in sorted(tracer.entered.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:5d} {short(module)}")
    print(f"calls up a layer: {sum(tracer.up.values())} ({len(tracer.up)} distinct)")
    for edge, n in sorted(tracer.up.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:5d} {edge.replace(TOP + '.', '')}")


def _ops(fop, tmp: str):
    """(title, walked call[, warm-ups]) for each operation: the warm-up calls (one unless
    named) do the first-call work (imports, jit, the directory's creation, the first
    reuse) so the walk is the steady state."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    params = {
        "dense": {"kernel": rng.standard_normal((64, 32), dtype=np.float32), "bias": np.zeros(32)},
        "out": {"kernel": rng.standard_normal((32, 8), dtype=np.float32)},
    }
    state = {"params": params, "opt_state": {"mu": params, "count": np.int32(3)}, "step": 3}
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), params)
    steps = iter(range(10, 10_000))

    mngr = fop.CheckpointManager(f"{tmp}/async")  # async_save=True: save, then wait
    incr = fop.CheckpointManager(f"{tmp}/incr", incremental=True, async_save=False)
    cb = fop.CheckpointCallback(f"{tmp}/cb", every_steps=1)

    def manager_save():
        mngr.save(next(steps), state)
        mngr.wait()

    def callback_step():
        cb.on_step_end(next(steps), state)
        cb.manager.wait()

    def incremental_save():
        incr.save(next(steps), state)

    return [
        ("save: fop.save of a small tree", lambda: fop.save(f"{tmp}/one", params, force=True)),
        ("restore: fop.restore of it", lambda: fop.restore(f"{tmp}/one")),
        ("manager: CheckpointManager.save (async) and wait", manager_save),
        ("serve: restore_params", lambda: fop.restore_params(f"{tmp}/async", like=like)),
        ("callback: CheckpointCallback.on_step_end with a save", callback_step),
        ("reuse: an incremental manager save (nothing changed)", incremental_save, 2),
    ], (mngr, incr, cb)


def main() -> int:
    import flax_orbax_plugin as fop  # here: the one on PYTHONPATH; JAX loads late

    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        ops, closing = _ops(fop, tmp)
        try:
            for title, call, *warm in ops:
                for _ in range(warm[0] if warm else 1):
                    call()
                t = _Tracer()
                t.run(call)
                _report(title, t)
                summary.append(
                    (title.split(":")[0], len(t.entered), _lines(t.entered), sum(t.up.values()))
                )
        finally:
            for opened in closing:
                opened.close()
    print("== hidden modes (tools/state_scan.py)")
    counts = report(Path(fop.__file__).resolve().parent)
    print("== summary: modules entered, the lines they hold, calls up a layer")
    for name, n, lines, up in summary:
        print(f"  {name:9s} {n:3d} {lines:6d} {up:5d}")
    ctx, state, tests = counts
    print(f"  context variables {ctx}, module-level mutable state {state}, ", end="")
    print(f"format-version tests outside the seam {tests}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
