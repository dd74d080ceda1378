"""Ctrl-C leaves nothing behind and is never lost (issue 32, interrupts).

Every case is a real child process that receives a real SIGINT (``os.kill`` from the
test) while it is paused at a known point of a save, an import or an export:
``FOP_PAUSE_AT`` (``_base/env.pause_point``) makes the child print
``FOP_PAUSED <point>`` on stderr and sleep there, and the test signals it the moment
it reads that line. Points: ``snapshot`` (the blocking phase, on the main thread),
``mid_write`` (the background write), ``before_commit`` (every process durable, the
commit next), ``export_placed`` (an export's first shard renamed into place, the
second not yet).

Afterwards: the child died of the KeyboardInterrupt (it did not run on to its end),
no staging (``*.partial-*``, ``*.deleting-*``, an export's temporary files, an
import's empty output directory) is left, and what was committed before is untouched.
The children of one test run side by side (the machine's cores are few and a child
spends most of its time importing jax).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from subprocess import PIPE

import _multiprocess
import _proc
import numpy as np
import pytest
from flax import serialization

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import ownership as _ownership
from flax_orbax_plugin.cli.main import main as cli_main

pytest_plugins = ["_servers"]

PARALLEL = 5  # children at once (each is mostly jax's import: CPU-bound)
PAUSE_S = "3"  # how long a child waits at its pause point for the test's signal
# From the pause to the signal: the main thread gets there meanwhile (into the wait for
# a background phase that is paused, or the user's loop), whatever the machine's load.
SIGNAL_DELAY_S = 0.3
DEADLINE_S = 150.0  # for every child of one test together (a loaded 2-core machine)
STAGING = re.compile(r"\.(partial|deleting)-|\.tmp-")

CHILD = r"""
import sys, time
import numpy as np
import flax_orbax_plugin as fop

mode, d = sys.argv[1], sys.argv[2]
tree = {f"l{i}": np.full((20_000,), i, np.float32) for i in range(4)}
tree["small"] = np.arange(3.0)


def train(seconds):  # the user's loop: where a SIGINT of a background phase lands
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


if mode == "save":
    fop.save(f"{d}/ckpt", tree)
elif mode == "save_async":
    handle = fop.save_async(f"{d}/ckpt", tree)
    print("save_async returned", flush=True)
    handle.wait()
elif mode == "manager_wait":
    with fop.CheckpointManager(f"{d}/run") as mngr:
        mngr.save(2, {"params": tree}, ignore_policy=True)
        print("save returned", flush=True)
        mngr.wait()
elif mode == "manager_training":  # never closed: the interpreter exits under the save
    mngr = fop.CheckpointManager(f"{d}/run")
    mngr.save(2, {"params": tree}, ignore_policy=True)
    print("save returned", flush=True)
    train(30)
elif mode == "callback":
    cb = fop.CheckpointCallback(f"{d}/run", every_steps=1)
    state = cb.on_train_start({"params": tree})
    for step in range(1, 40):
        cb.on_step_end(step, state)
    cb.on_train_end(state)
print("ran to the end", flush=True)
"""

TREE = {f"l{i}": np.full((20_000,), i, np.float32) for i in range(4)}
EARLIER = {"w": np.arange(100, dtype=np.float32), "step": 1}


def _python(*args: str) -> list[str]:
    return [sys.executable, "-c", CHILD, *args]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "flax_orbax_plugin", *args]


@dataclasses.dataclass
class _Child:
    proc: subprocess.Popen
    out: bytes = b""
    err: bytes = b""
    signal_at: float | None = None  # when to send SIGINT (set once it paused)
    signalled: bool = False
    pipes: int = 2  # still open


def _interrupt_all(cases: dict[str, tuple[list[str], str]]) -> dict[str, tuple[int, str, str]]:
    """Runs every ``{name: (argv, pause point)}`` child, ``PARALLEL`` at a time; sends
    each one SIGINT ``SIGNAL_DELAY_S`` after it reports its pause; returns ``{name:
    (exit code, stdout, stderr)}``. A child that never pauses, or runs past the
    deadline, is killed and fails the test."""
    waiting, live, done = list(cases), {}, {}
    deadline = time.monotonic() + DEADLINE_S
    with selectors.DefaultSelector() as sel:
        try:
            while waiting or live:
                while waiting and len(live) < PARALLEL:
                    name = waiting.pop(0)
                    argv, point = cases[name]
                    env = _proc.child_env(FOP_PAUSE_AT=point, FOP_PAUSE_S=PAUSE_S)
                    env["JAX_PLATFORMS"] = "cpu"
                    child = live[name] = _Child(
                        subprocess.Popen(argv, env=env, stdout=PIPE, stderr=PIPE)
                    )
                    sel.register(child.proc.stdout, selectors.EVENT_READ, (name, "out"))
                    sel.register(child.proc.stderr, selectors.EVENT_READ, (name, "err"))
                now = time.monotonic()
                assert now < deadline, f"children still running after {DEADLINE_S} s: {list(live)}"
                for child in live.values():
                    if not child.signalled and child.signal_at and now >= child.signal_at:
                        os.kill(child.proc.pid, signal.SIGINT)  # a real Ctrl-C
                        child.signalled = True
                for key, _ in sel.select(0.02):
                    name, which = key.data
                    child = live[name]
                    chunk = os.read(key.fd, 65536)
                    setattr(child, which, getattr(child, which) + chunk)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        child.pipes -= 1
                    elif child.signal_at is None and b"FOP_PAUSED" in child.err:
                        child.signal_at = time.monotonic() + SIGNAL_DELAY_S
                    if child.pipes == 0:
                        del live[name]
                        code = child.proc.wait(timeout=30)
                        what = f"{name}: never paused, or not signalled: {child.out}{child.err}"
                        assert child.signalled, what
                        done[name] = (code, child.out.decode(), child.err.decode())
        finally:
            for child in live.values():
                child.proc.kill()
                child.proc.wait()
    return done


def _died_of_ctrl_c(result: tuple[int, str, str], name: str) -> None:
    code, stdout, stderr = result
    assert code == -signal.SIGINT, f"{name}: exit {code}\n{stdout}\n{stderr}"
    assert stderr.rstrip().endswith("KeyboardInterrupt"), f"{name}: {stderr}"
    assert "ran to the end" not in stdout, f"{name}: the interrupt was lost: {stdout}"


def _raised_at_end_of_blocking_phase(stderr: str, name: str) -> None:
    """The KeyboardInterrupt surfaced once the blocking phase was over (raised again by
    the deferral), not from wherever the main thread happened to be inside it."""
    frames = re.findall(r'File "([^"]+)"', stderr)
    assert frames and frames[-1].endswith(os.path.join("_base", "interrupts.py")), (
        f"{name}: not deferred to the end of the blocking phase:\n{stderr}"
    )


def _no_staging(directory, name: str) -> None:
    names = [n for _, dirs, files in os.walk(directory) for n in dirs + files]
    assert not [n for n in names if STAGING.search(n)], f"{name}: staging left: {names}"


def _earlier_intact(path) -> None:
    out = fop.restore(path)
    np.testing.assert_array_equal(out["w"], EARLIER["w"])
    assert out["step"] == 1


SAVES = {  # name: (the child's mode, its pause point)
    "save@mid_write": ("save", "mid_write"),
    "save@before_commit": ("save", "before_commit"),
    "save_async@snapshot": ("save_async", "snapshot"),
    "manager@mid_write": ("manager_wait", "mid_write"),
    "manager@before_commit": ("manager_training", "before_commit"),
    "callback@snapshot": ("callback", "snapshot:3"),  # the third save's blocking phase
    "callback@mid_write": ("callback", "mid_write:3"),  # its write; step 4 waits on it
}


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Every case of this file that a SIGINT interrupts, run once (side by side):
    ``{name: (its directory, (exit code, stdout, stderr))}``, plus ``"before"``: what
    each directory held (the earlier checkpoint or step) before its child ran."""
    root = tmp_path_factory.mktemp("interrupts")
    dirs, cases = {}, {}
    for name, (mode, point) in SAVES.items():
        d = dirs[name] = root / name.replace("@", "-")
        if mode.startswith("save"):
            fop.save(d / "earlier", EARLIER)
        elif mode.startswith("manager"):
            with fop.CheckpointManager(d / "run") as mngr:
                mngr.save(1, {"params": EARLIER}, ignore_policy=True)
        else:
            d.mkdir()
        cases[name] = (_python(mode, str(d)), point)
    source = root / "flax_ckpt_7"
    source.write_bytes(serialization.msgpack_serialize({"params": TREE, "step": 7}))
    fop.save(root / "ckpt", TREE)
    dirs["import"] = root / "new"
    cases["import"] = (_cli("import", str(source), str(root / "new" / "run")), "mid_write")
    dirs["export"] = root / "out"  # the first shard renamed into place, the second not yet
    out = root / "out" / "hf" / "model.safetensors"
    argv = _cli("export", str(root / "ckpt"), str(out), "--max-shard-size", "100KB")
    cases["export"] = (argv, "export_placed")
    before = {n: sorted(os.listdir(d)) for n, d in dirs.items() if d.exists()}
    before.update(
        {n: sorted(os.listdir(d / "run")) for n, d in dirs.items() if (d / "run").exists()}
    )
    results = _interrupt_all(cases)
    return {n: (dirs[n], results[n]) for n in cases} | {"before": before, "root": root}


def test_ctrl_c_during_fop_save_and_save_async_leaves_nothing(interrupted):
    for name in [n for n in SAVES if n.startswith("save")]:
        d, result = interrupted[name]
        _died_of_ctrl_c(result, name)
        assert sorted(os.listdir(d)) == ["earlier"], (name, os.listdir(d))
        _earlier_intact(d / "earlier")
    _raised_at_end_of_blocking_phase(interrupted["save_async@snapshot"][1][2], "save_async")
    assert "save_async returned" not in interrupted["save_async@snapshot"][1][1]


def test_ctrl_c_during_manager_and_callback_saves_leaves_nothing(interrupted):
    before = interrupted["before"]
    for name in [n for n in SAVES if n.startswith(("manager", "callback"))]:
        d, result = interrupted[name]
        _died_of_ctrl_c(result, name)
        _no_staging(d, name)
    _raised_at_end_of_blocking_phase(interrupted["callback@snapshot"][1][2], "callback")
    assert "save returned" in interrupted["manager@mid_write"][1][1]
    run = interrupted["manager@mid_write"][0] / "run"
    assert sorted(os.listdir(run)) == before["manager@mid_write"]
    # Interrupted in the user's loop while the step was in the background: the step
    # either committed whole as the interpreter waited for it, or is gone.
    run = interrupted["manager@before_commit"][0] / "run"
    was = set(before["manager@before_commit"])
    assert was <= set(os.listdir(run)) <= {*was, "2"}
    with fop.CheckpointManager(run, read_only=True) as mngr:
        assert mngr.steps()[0] == 1
        np.testing.assert_array_equal(mngr.restore(step=1)["params"]["w"], EARLIER["w"])
        if 2 in mngr.steps():
            np.testing.assert_array_equal(mngr.restore(step=2)["params"]["l3"], TREE["l3"])
    for name in ("callback@snapshot", "callback@mid_write"):
        with fop.CheckpointManager(interrupted[name][0] / "run", read_only=True) as mngr:
            steps = mngr.steps()
            # The third step's save was cancelled (mid_write: a Ctrl-C that a starved
            # machine delivers before step 4 waits on it leaves step 3 to commit whole).
            assert steps == [1, 2] or (name.endswith("mid_write") and steps == [1, 2, 3])
            for step in steps:
                np.testing.assert_array_equal(mngr.restore(step=step)["params"]["l1"], TREE["l1"])


def test_ctrl_c_during_import_and_export_leaves_nothing(interrupted):
    for name in ("import", "export"):
        d, (code, stdout, stderr) = interrupted[name]
        assert code == 130 and "interrupted" in stderr, f"{name}: {code}\n{stdout}\n{stderr}"
        assert "imported step" not in stdout and "wrote" not in stdout, name
        # The output directory did not exist: created by the import or export, all of it
        # goes (an import's lock file, an export's shard already in place).
        assert not d.exists(), (name, [(p, f) for p, _, f in os.walk(d)])
    exported = fop.restore(interrupted["root"] / "ckpt")  # the export's source: untouched
    np.testing.assert_array_equal(exported["l2"], TREE["l2"])


def _object_store_case(store, scheme: str) -> None:
    """On an object store a save writes in place (no staging name): an interrupted core
    save removes what it wrote there, a manager its uncommitted step; earlier data stays."""
    fop.save(store.join("earlier").url, EARLIER)
    with fop.CheckpointManager(store.join("run").url) as mngr:
        mngr.save(1, {"params": EARLIER}, ignore_policy=True)
    before = sorted(store.keys())
    cases = {
        f"{scheme} save@mid_write": (_python("save", store.url), "mid_write"),
        f"{scheme} manager@mid_write": (_python("manager_wait", store.url), "mid_write"),
    }
    for name, result in _interrupt_all(cases).items():
        _died_of_ctrl_c(result, name)
    assert sorted(store.keys()) == before
    _earlier_intact(store.join("earlier").url)
    with fop.CheckpointManager(store.join("run").url, read_only=True) as mngr:
        assert mngr.steps() == [1]


def test_ctrl_c_during_saves_to_s3_leaves_nothing(s3_location):
    _object_store_case(s3_location, "s3")


def test_ctrl_c_during_saves_to_gcs_leaves_nothing(gcs_location):
    _object_store_case(gcs_location, "gs")


def save_with_one_process_interrupted(ctx, directory: str) -> dict:
    """Two-process target: both save one checkpoint; process 0 is sent SIGINT while it
    is about to commit. Returns what each saw, and how long its save took."""
    start = time.monotonic()
    try:
        fop.save(f"{directory}/ckpt", TREE)
        outcome = "saved"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except fop.CheckpointError as e:
        outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "seconds": time.monotonic() - start}


def test_ctrl_c_on_one_of_two_processes_fails_the_save_on_both_and_leaves_nothing(tmp_path):
    """The interrupted process's commit fails, every other process learns it at once
    from the commit protocol (not after a timeout), and nothing is left."""
    fop.save(tmp_path / "earlier", EARLIER)
    work = tmp_path / "mp"
    work.mkdir()
    stderr_0 = work / "stderr_0.txt"
    run = _multiprocess.run_processes(
        "test_interrupts:save_with_one_process_interrupted",
        n=2,
        args={"directory": str(tmp_path)},
        env={"FOP_PAUSE_AT": "before_commit", "FOP_PAUSE_S": PAUSE_S},
        workdir=str(work),
        signals=[
            _multiprocess.Signal(
                process=0,
                when=lambda: stderr_0.exists() and "FOP_PAUSED" in stderr_0.read_text(),
                signum=signal.SIGINT,
            )
        ],
        timeout_s=120,
    )
    assert run.signals_sent, "\n".join(p.describe() for p in run.procs)
    assert run[0].result["outcome"] == "KeyboardInterrupt", run[0].describe()
    other = run[1].result
    assert other["outcome"].startswith("CheckpointError") and "process 0" in other["outcome"], run[
        1
    ].describe()
    assert other["seconds"] < 30, other  # told by the commit protocol, not by a timeout
    assert sorted(os.listdir(tmp_path)) == ["earlier", "mp"]
    _earlier_intact(tmp_path / "earlier")


def test_a_killed_save_is_removed_as_ours_by_the_next_save_and_by_gc(tmp_path, capsys):
    """Where the interrupted save cannot clean up (SIGKILL in its write), its staging
    carries our marker naming the dead writer: the next save of that path removes it
    at once, and ``gc`` (the CLI, and the Python ``gc``) removes copies of it under
    other names; a staging whose writer still runs (another live process) stays."""
    fop.save(tmp_path / "earlier", EARLIER)
    env = _proc.child_env(FOP_KILL_AT="mid_write", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        _python("save", str(tmp_path)), env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    (dead,) = [n for n in os.listdir(tmp_path) if n.startswith("ckpt.partial-")]
    dead_pid = json.loads((tmp_path / dead / _ownership.PENDING_FILE).read_bytes())["pid"]
    assert dead_pid != os.getpid()  # the marker names the killed child
    shutil.copytree(tmp_path / dead, tmp_path / "other.partial-dead02")  # same dead writer
    live = tmp_path / "live.partial-live03"
    live.mkdir()
    marker = json.loads(_ownership._pending_bytes("live03"))
    marker["pid"] = os.getppid()  # a save of another process that still runs
    (live / _ownership.PENDING_FILE).write_text(json.dumps(marker))
    fop.save(tmp_path / "ckpt", TREE)  # the next save of that path
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt",
        "earlier",
        "live.partial-live03",
        "other.partial-dead02",
    ]
    assert cli_main(["gc", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "removed unfinished: other.partial-dead02" in out, out
    third = tmp_path / "third.partial-dead04"  # the killed child's, for the Python gc
    shutil.copytree(live, third)
    (third / _ownership.PENDING_FILE).write_text(json.dumps({**marker, "pid": dead_pid}))
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.gc()
    left = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    assert left == ["ckpt", "earlier", "live.partial-live03"]
    _earlier_intact(tmp_path / "earlier")
    np.testing.assert_array_equal(fop.restore(tmp_path / "ckpt")["l0"], TREE["l0"])
