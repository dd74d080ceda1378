"""An ``on_event`` hook that calls back into its manager: what reads committed steps
works (``restore(step=...)`` from SaveCommitted, to evaluate each checkpoint), what
would wait for the thread delivering the event is refused with HookReentryError naming
the call; never a hang, on every event's thread (the save's, retention's, the
persistent tier's replication) and for every waiting call (manager, save handle,
persistent tier).

The scenarios run in a child process: one that hangs (today's failure) is reported by
the child's own watchdog, and leaves no stuck thread in the test process."""

import json
import subprocess
import sys
import textwrap

import _proc

CHILD = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import numpy as np
    import flax_orbax_plugin as fop

    root = sys.argv[1]
    CALLS = {
        "restore_step": lambda m, e: m.restore(step=e.step)["params"]["w"].tolist(),
        "restore_latest": lambda m, e: m.restore()["params"]["w"].tolist(),
        "steps": lambda m, e: m.steps(),
        "wait": lambda m, e: m.wait(),
        "wait_for_save": lambda m, e: m.wait_for_save(),
        "save": lambda m, e: m.save(e.step + 100, tree(0), ignore_policy=True),
        "close": lambda m, e: m.close(),
        "delete": lambda m, e: m.delete(e.step),
        "gc": lambda m, e: m.gc(),
        "handle_wait": lambda m, e: m.pending_save and m.pending_save.wait(),
        "handle_cancel": lambda m, e: m.pending_save and m.pending_save.cancel(),
        "persistent_wait": lambda m, e: m.persistent.wait(),
        "persistent_close": lambda m, e: m.persistent.close(),
    }

    def tree(v):
        return {"params": {"w": np.full(4, float(v))}}

    def scenario(n, call, kind):
        out = {}
        box = {}

        def hook(event):
            if type(event).__name__ != kind or "outcome" in out or "m" not in box:
                return
            out["entered"] = True
            try:
                got = CALLS[call](box["m"], event)
                out["outcome"] = ["ok", got]
            except fop.CheckpointError as e:
                out["outcome"] = [type(e).__name__, str(e)]
                raise  # the hook's error: kept, raised by the next wait (an EventHookError)
            finally:
                out["thread"] = threading.current_thread().name

        d = os.path.join(root, f"run{n}")
        tiered = kind == "StepReplicated" or call.startswith("persistent")
        tier = d + "-persistent" if tiered else None  # else retention waits for no copy
        m = fop.CheckpointManager(d, keep=1, on_event=hook, persistent=tier)
        box["m"] = m
        after = []  # the hook's errors, raised again on the training thread
        for step in (1, 2) if kind == "StepsRemoved" else (1,):
            try:  # a training-thread event's: by the save itself (its step saved)
                m.save(step, tree(step))
            except fop.EventHookError as e:
                after.append(type(e.__cause__).__name__)
        deadline = time.monotonic() + 20
        while "outcome" not in out:  # the training thread leaves the manager alone
            if time.monotonic() > deadline:
                said = "HANG" if out.get("entered") else "NO EVENT"
                print(said, call, kind, flush=True)
                os._exit(3)
            time.sleep(0.01)
        try:
            m.wait()
        except fop.EventHookError as e:
            after.append(type(e.__cause__).__name__)
        m.close()
        out.update(after=after, steps=sorted(fop.CheckpointManager(d, read_only=True).steps()))
        return out

    results = {}
    for n, spec in enumerate(sys.argv[2:]):
        call, kind = spec.split("@")
        results[spec] = scenario(n, call, kind)
    print("RESULTS " + json.dumps(results), flush=True)
    """
)

RESTORES = ["restore_step@SaveCommitted", "restore_latest@SaveCommitted"]
READS_ELSEWHERE = [
    "restore_step@StepsRemoved",
    "restore_step@StepReplicated",
    "steps@SaveCommitted",
]
REFUSED = {
    "wait@SaveCommitted": "manager.wait()",
    "wait_for_save@SaveCommitted": "manager.wait_for_save()",
    "save@SaveCommitted": "manager.save()",
    "close@SaveCommitted": "manager.close()",
    "delete@SaveCommitted": "manager.delete()",
    "gc@SaveCommitted": "manager.gc()",
    "handle_wait@SaveCommitted": "SaveHandle.wait()",
    "handle_cancel@SaveCommitted": "SaveHandle.cancel()",
    "persistent_wait@SaveCommitted": "persistent.wait()",
    "wait@StepsRemoved": "manager.wait()",
    "close@StepsRemoved": "manager.close()",
    "wait@StepReplicated": "manager.wait()",
    "close@StepReplicated": "manager.close()",
    "persistent_wait@StepReplicated": "persistent.wait()",
    "persistent_close@StepReplicated": "persistent.close()",
    "save@SaveStarted": "manager.save()",
    "wait@SaveBlockingDone": "manager.wait()",
}


def run_child(tmp_path, specs):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), *specs],
        env=_proc.child_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert "HANG" not in proc.stdout and "NO EVENT" not in proc.stdout, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


def test_hooks_restore_committed_steps_and_are_refused_what_would_hang(tmp_path):
    specs = RESTORES + READS_ELSEWHERE + list(REFUSED)
    results = run_child(tmp_path, specs)
    for spec in RESTORES:  # evaluating each checkpoint from its SaveCommitted
        r = results[spec]
        assert r["outcome"] == ["ok", [1.0] * 4], (spec, r)
        assert r["thread"] == "fop-save" and r["after"] == [] and r["steps"] == [1], (spec, r)
    for spec in READS_ELSEWHERE:
        r = results[spec]
        assert r["outcome"][0] == "ok" and r["after"] == [], (spec, r)
    assert results["restore_step@StepsRemoved"]["outcome"][1] == [2.0] * 4
    assert results["restore_step@StepReplicated"]["outcome"][1] == [1.0] * 4
    for spec, call in REFUSED.items():
        r = results[spec]
        kind, message = r["outcome"]
        assert kind == "HookReentryError", (spec, r)
        assert message.startswith(call) and "refused rather than hang" in message, (spec, r)
        # Raised again, once, on the training thread (its next save or wait); no step lost.
        assert r["after"] == ["HookReentryError"], (spec, r)
        saved = [2] if spec.endswith("StepsRemoved") else [1]
        assert r["steps"] == saved, (spec, r)
