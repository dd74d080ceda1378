"""Real training programs SIGKILLed mid-run and resumed: bit-exact with an uninterrupted run.

Each test runs tests/support/_training_programs.py three times in subprocesses, one
after another: once uninterrupted, once SIGKILLed while it is stuck in a slow step
after a committed save, and once resumed with ``resume=True``. Every form of training
state trains in lockstep within one program, so the whole file costs three program
starts per test; the first run leaves the programs it compiled in JAX's persistent
compilation cache (a directory of the test's own), so the other two load them
instead of compiling them again (most of a run's time).
"""

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import _paths
import _proc
import pytest

REPO = _paths.REPO
PROGRAM = os.path.join(_paths.SUPPORT, "_training_programs.py")
HANG_AT = 6  # the kill comes during step 6: step 4 is saved, steps 5 and 6 are not
SAVED = 4
DEADLINE = 120  # seconds for any one program run


def _env(directory):
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device, the same in every run
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    # One cache per test, beside the run's directory; the runs are one at a time.
    env.update(_proc.compile_cache_env(os.path.join(os.path.dirname(directory), "jax_cache")))
    return env


def _check(out, cmd, returncode):
    assert returncode == 0, f"{cmd} exited {returncode}\n{out}"


def start_program(directory, forms, *flags):
    cmd = [sys.executable, PROGRAM, str(directory), ",".join(forms), *flags]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(directory),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return cmd, proc


def finish_program(cmd, proc):
    """Waits (bounded) for a program started by start_program; returns its output."""
    try:
        out, _ = proc.communicate(timeout=DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    _check(out, cmd, proc.returncode)
    return out


def run_program(directory, forms, *flags):
    return finish_program(*start_program(directory, forms, *flags))


def finals(out):
    return dict(re.findall(r"^final (\w+) ([0-9a-f]{64})$", out, re.M))


def run_and_kill(directory, forms):
    """Starts the program, waits (bounded) until it hangs after a committed save, SIGKILLs it."""
    cmd, proc = start_program(directory, forms, f"--hang-at={HANG_AT}")
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    seen = []
    deadline = time.monotonic() + DEADLINE
    try:
        while "hang\n" not in seen:
            try:
                seen.append(lines.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            if proc.poll() is not None and not reader.is_alive() and lines.empty():
                _check("".join(seen), cmd, proc.returncode)
                pytest.fail(f"program ended before hanging:\n{''.join(seen)}")
            if time.monotonic() > deadline:
                pytest.fail(f"no 'hang' line within {DEADLINE} s; output:\n{''.join(seen)}")
        # Step 4's save runs in the background: wait (bounded) until it is committed.
        while not all(os.path.isdir(directory / f / str(SAVED)) for f in forms):
            assert time.monotonic() < deadline, f"step {SAVED} never committed: {''.join(seen)}"
            assert proc.poll() is None, "".join(seen)
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=10)
    return "".join(seen)


def assert_kill_and_resume_bit_exact(tmp_path, forms):
    # The uninterrupted reference first: the runs after it load what it compiled.
    reference = finals(run_program(tmp_path / "reference", forms))
    killed = run_and_kill(tmp_path / "run", forms)
    assert set(reference) == set(forms)
    assert "final" not in killed
    for form in forms:  # the kill left only committed step 4 behind (no step 8 yet)
        steps = sorted(n for n in os.listdir(tmp_path / "run" / form) if n.isdigit())
        assert steps == [str(SAVED)], (form, steps)

    out = run_program(tmp_path / "run", forms, "--resume")
    for form in forms:
        assert f"resumed {form} {SAVED}\n" in out
    assert finals(out) == reference  # every array, bit for bit


FORMS = ["linen_bn_ds", "nnx_pair", "nnx_mao", "nnx_dict", "nnx_dropout", "nnx_own_streams"]
# States with items without arrays: a TrainState with plain optax.sgd and
# dynamic_scale=None; NNX with optax.sgd. In the same programs (three starts in all).
EMPTY_ITEMS = ["linen_sgd_none", "nnx_sgd"]


def test_linen_and_nnx_training_states_resume_bit_exact_after_sigkill(tmp_path):
    assert_kill_and_resume_bit_exact(tmp_path, FORMS + EMPTY_ITEMS)
