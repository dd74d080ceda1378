"""Walks through the package, measured: which modules a call enters, and calls that go up.

    python tools/walks.py

Runs three operations on small trees (CPU, a temporary directory) under a profiler
that sees every Python call in every thread, and reports for each:

- the package modules entered from another package module, with the number of
  such entries (a module entered many times is a walk that keeps coming back);
- the calls from a wing into a wing ranked above it ("up a layer"), by caller and
  callee function, with counts.

The operations: ``state`` through ``CheckpointManager.save``; ``reuse`` through an
incremental save (the second step of an ``incremental=True`` manager); ``like``
through ``restore_params``. Works on the flat layout of before the wings as well
(``FLAT_WINGS`` maps its modules to the wings they moved to), so one script gives
the before and after figures. Single-threaded driver; not a test.
"""

from __future__ import annotations

import collections
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from import_graph import WINGS

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


def _report(title: str, tracer: _Tracer) -> None:
    short = lambda m: m[len(TOP) + 1 :]
    print(f"== {title}")
    print(f"modules entered: {len(tracer.entered)}")
    for module, n in sorted(tracer.entered.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:5d} {short(module)}")
    print(f"calls up a layer: {sum(tracer.up.values())} ({len(tracer.up)} distinct)")
    for edge, n in sorted(tracer.up.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:5d} {edge.replace(TOP + '.', '')}")


def main() -> int:
    import jax
    import numpy as np

    import flax_orbax_plugin as fop

    rng = np.random.default_rng(0)
    params = {
        "dense": {"kernel": rng.standard_normal((64, 32), dtype=np.float32), "bias": np.zeros(32)},
        "out": {"kernel": rng.standard_normal((32, 8), dtype=np.float32)},
    }
    state = {"params": params, "opt_state": {"mu": params, "count": np.int32(3)}, "step": 3}
    with tempfile.TemporaryDirectory() as tmp:
        plain, incr = f"{tmp}/plain", f"{tmp}/incr"
        with fop.CheckpointManager(plain, async_save=False) as mngr:
            mngr.save(0, state)  # warm: first-call work (imports, jit) is not the walk
            t = _Tracer()
            t.run(lambda: mngr.save(1, state))
            _report("state through CheckpointManager.save", t)
        with fop.CheckpointManager(incr, incremental=True, async_save=False) as mngr:
            mngr.save(1, state)
            t = _Tracer()
            t.run(lambda: mngr.save(2, state))
            _report("reuse through an incremental save (step 2, nothing changed)", t)
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), params
        )
        fop.restore_params(plain, like=like)
        t = _Tracer()
        t.run(lambda: fop.restore_params(plain, like=like))
        _report("like through restore_params", t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
