"""Child process of tests/end_to_end/test_host_memory.py and benchmarks/bench_host_memory.py:
runs each path of the library that moves data under one host-memory ceiling and prints,
per path, its peak resident memory above the resident memory before it (the kernel's
VmHWM, reset before each path through /proc/self/clear_refs), less the bytes of the
result the path returns, and its time.

    python _host_memory_child.py DIR CEILING_BYTES STATE_MIB PATH[,PATH...]

Linux only (VmHWM and its reset)."""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import time


def _kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    directory, ceiling, state_mib, paths = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    import flax.serialization
    import jax
    import numpy as np

    import flax_orbax_plugin as fop
    from flax_orbax_plugin.cli.main import main as cli

    leaves = 8
    rows = state_mib * 2**20 // leaves // (4 * 1024)
    rng = np.random.default_rng(0)
    state = {
        f"w{i}": jax.numpy.asarray(rng.random((rows, 1024), dtype=np.float32))
        for i in range(leaves)
    }
    state_bytes = sum(x.nbytes for x in state.values())
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    run, C = os.path.join(directory, "run"), ceiling
    out: dict = {"state_bytes": state_bytes, "ceiling": C}

    def measure(name, fn, held=False):
        gc.collect()
        before = _kib("VmRSS")
        _reset_peak()
        t = time.perf_counter()
        try:
            result, error = fn(), None
            if name.startswith("cli_") and result != 0:  # the command's exit status
                result, error = None, f"exit status {result}"
        except Exception as e:  # noqa: BLE001 - a refusal: its words are checked by the test
            result, error = None, f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t
        peak = _kib("VmHWM")
        kept = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(result)) if held else 0
        out[name] = {"extra": (peak - before) * 1024 - kept, "seconds": seconds, "error": error}
        del result

    def manager_save():
        with fop.CheckpointManager(run, host_memory=C) as m:
            m.save(1, {"params": state})

    def manager_restore():
        with fop.CheckpointManager(run, host_memory=C, read_only=True) as m:
            return m.restore(like={"params": like})

    def manager_restore_limit():  # the ceiling of one restore, the manager's unset
        with fop.CheckpointManager(run, read_only=True) as m:
            return m.restore(like={"params": like}, memory_limit_bytes=C)

    def resume():
        cb = fop.CheckpointCallback(run, resume=True, host_memory=C)
        try:
            return cb.on_train_start({"params": like})
        finally:
            cb.close()

    def pooled_save():  # the control: one host copy of the state kept (the harness sees it)
        with fop.CheckpointManager(os.path.join(directory, "pooled"), reuse_host_buffers=True) as m:
            m.save(1, {"params": state})

    def hundred_saves(name="hundred_saves"):  # the defaults: RSS after each of 100 saves
        small = {k: v[: max(1, rows // 64)] for k, v in state.items()}
        gc.collect()
        out[f"{name}_before"] = _kib("VmRSS") * 1024
        rss = []
        with fop.CheckpointManager(os.path.join(directory, name), keep=2) as m:
            for step in range(100):
                m.save(step, {"params": small})
                m.wait()
                gc.collect()
                rss.append(_kib("VmRSS") * 1024)
        out[f"{name}_rss"] = rss
        out[f"{name}_state_bytes"] = sum(x.nbytes for x in small.values())

    def hundred_device_saves():  # the same through the accelerator's device staging
        from flax_orbax_plugin._core import device_copy

        device_copy.CPU_AS_DEVICE = True
        try:
            hundred_saves("hundred_device_saves")
        finally:
            device_copy.CPU_AS_DEVICE = False

    def tier_copy():  # a manager's step replicated to a local persistent tier, and back
        remote = os.path.join(directory, "persistent")
        options = {"host_memory": C, "persistent": fop.Tier(remote)}
        with fop.CheckpointManager(os.path.join(directory, "tiered"), **options) as m:
            m.save(1, {"params": state})
            m.wait()  # the copy up: done before wait() returns
        gc.collect()
        return os.listdir(remote)

    def copy_down():  # the local step lost: the manager copies it down from the tier
        import shutil

        local = os.path.join(directory, "tiered")
        shutil.rmtree(os.path.join(local, "1"))
        options = {"host_memory": C, "persistent": fop.Tier(os.path.join(directory, "persistent"))}
        with fop.CheckpointManager(local, **options) as m:
            return m.restore(like={"params": like})

    def orbax_dir(name, tree):
        import orbax.checkpoint as ocp

        path = os.path.join(directory, name)
        if not os.path.exists(path):
            with ocp.CheckpointManager(path) as m:
                m.save(1, args=ocp.args.StandardSave(tree))
                m.wait_until_finished()
        return path

    small = {k: v[: rows // 16] for k, v in state.items()}  # 1/16 of the state: C/2 here
    quarter = {k: v[: rows // 4] for k, v in state.items()}  # twice the ceiling

    def msgpack_file():
        path = os.path.join(directory, "state.msgpack")
        if not os.path.exists(path):
            host = {"params": {k: np.asarray(v) for k, v in state.items()}, "step": 3}
            with open(path, "wb") as f:
                f.write(flax.serialization.msgpack_serialize(host))
        return path

    steps = {
        "save": lambda: fop.save(os.path.join(directory, "core"), state, host_memory_budget=C),
        "manager_save": manager_save,
        "restore": lambda: fop.restore(
            os.path.join(directory, "core"), like=like, memory_limit_bytes=C
        ),
        "manager_restore": manager_restore,
        "manager_restore_limit": manager_restore_limit,
        "resume": resume,
        "serve": lambda: fop.restore_params(run, like=like, memory_limit_bytes=C),
        "export": lambda: fop.to_safetensors(
            os.path.join(run, "1", "params"),
            os.path.join(directory, "x.safetensors"),
            force=True,
            memory_limit_bytes=C,
        ),
        "cli_export": lambda: cli(
            [
                "export",
                run,
                os.path.join(directory, "y.safetensors"),
                "--force",
                "--memory-limit",
                str(C),
            ]
        ),
        "import": lambda: fop.import_msgpack(
            msgpack_file(), os.path.join(directory, "imp"), memory_limit_bytes=C
        ),
        "cli_import": lambda: cli(
            ["import", msgpack_file(), os.path.join(directory, "imp2"), "--memory-limit", str(C)]
        ),
        "from_safetensors": lambda: fop.from_safetensors(
            os.path.join(directory, "x.safetensors"), like, memory_limit_bytes=C
        ),
        "from_safetensors_refused": lambda: fop.from_safetensors(
            os.path.join(directory, "x.safetensors"), like, memory_limit_bytes=C // 2
        ),
        "verify": lambda: fop.verify(run, memory_limit_bytes=C),
        "cli_verify": lambda: cli(["verify", run, "--memory-limit", str(C)]),
        "import_orbax": lambda: fop.import_orbax(
            orbax_dir("orbax_small", small), os.path.join(directory, "imp3"), memory_limit_bytes=C
        ),
        "import_orbax_refused": lambda: fop.import_orbax(
            orbax_dir("orbax", quarter), os.path.join(directory, "imp4"), memory_limit_bytes=C
        ),
        "cli_import_orbax": lambda: cli(
            ["import", orbax_dir("orbax", quarter), os.path.join(directory, "imp5")]
            + ["--memory-limit", str(C)]
        ),
        "tier_copy": tier_copy,
        "copy_down": copy_down,
        "pooled_save": pooled_save,
        "hundred_saves": hundred_saves,
        "hundred_device_saves": hundred_device_saves,
    }
    held = {
        "restore",
        "manager_restore",
        "manager_restore_limit",
        "resume",
        "serve",
        "from_safetensors",
        "copy_down",
    }
    if "import" in paths:
        msgpack_file()  # written before any path is measured
    if "import_orbax" in paths:  # written before any path is measured
        orbax_dir("orbax", quarter)
        orbax_dir("orbax_small", small)
    # Everything made so far (the modules, the state) moved out of the collector's reach:
    # each gc.collect() before a figure then walks only what the paths made, not the
    # whole heap of jax and its imports (~70 ms each, ~200 of them). Freezing can only
    # keep objects alive, never free one, so no figure can come out lower for it.
    gc.collect()
    gc.freeze()
    for name in paths.split(","):
        measure(name, steps[name], held=name in held)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
