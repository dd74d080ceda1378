"""The examples through their real command lines, in subprocesses.

A small configuration (overridden on the command line, as a user would) keeps
these fast; `make demo` runs the full-size main job. Every run of this file shares
JAX's persistent compilation cache (one directory per test worker: the runs on it are
one at a time): a run loads the programs an earlier run compiled (the model's
initialisation, op by op, and the training step: ~4.5 s of a run's ~9 s on CPU). What
is compared (digests, losses, exit codes) is computed by the runs either way.
"""

import os
import re
import shutil
import signal
import subprocess
import sys

import _paths
import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop

# Each example run has its own subprocess timeout; these add up past the global 300 s.
pytestmark = pytest.mark.timeout(600)

REPO = _paths.REPO
CONFIG = os.path.join(REPO, "configs", "default.py")
SMALL = [
    "--config.num_train_steps=300",
    "--config.batch_size=64",
    "--config.learning_rate=3e-3",
    "--config.log_every_steps=50",
    "--config.checkpoint.every_steps=50",
]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """The compilation cache of this file's runs: per worker (tmp_path_factory's base
    is the worker's own under xdist), so no two runs write it at once."""
    return tmp_path_factory.mktemp("examples_jax_cache")


def _env(cache):
    """The example's environment, with the compilation cache ``cache`` (a directory)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device, as a user's laptop
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(_proc.compile_cache_env(cache))
    return env


def example_cmd(script, *flags):
    return [sys.executable, os.path.join(REPO, "examples", script), f"--config={CONFIG}", *flags]


def run_example(cache, script, *flags, timeout=180):
    cmd = example_cmd(script, *flags)
    p = subprocess.run(
        cmd, cwd=REPO, env=_env(cache), capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, f"{cmd} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


def digest(out, kind):
    return re.search(rf"^{kind} params sha256 ([0-9a-f]{{64}})$", out, re.M).group(1)


def losses(out):
    return [float(m) for m in re.findall(r"^step\s+\d+ \| loss ([0-9.e+-]+)", out, re.M)]


def test_resume_from_the_config_flag_and_serve(tmp_path, jax_cache):
    ckpt = tmp_path / "ckpt"
    where = f"--config.checkpoint.directory={ckpt}"

    out = run_example(jax_cache, "train.py", *SMALL, where)
    assert "starting from scratch" in out
    first = digest(out, "final")
    curve = losses(out)
    assert len(curve) == 6 and curve[-1] < 0.8 * curve[0], curve  # it learns
    # each save's events reach the example's writer (fop.MetricWriterEvents)
    assert re.search(r"^checkpoint   300 \| blocking [0-9.]+ s$", out, re.M)
    committed = r"^checkpoint   300 \| committed: background [0-9.]+ s \| total [0-9.]+ s \| "
    assert re.search(committed + r"\d+ files, [0-9.]+ MiB \| [0-9.]+ GB/s$", out, re.M)
    assert sorted(int(n) for n in os.listdir(ckpt) if n.isdigit()) == [200, 250, 300]  # keep=3

    # As if the run had died after step 200: the later steps never got written.
    shutil.rmtree(ckpt / "250")
    shutil.rmtree(ckpt / "300")

    out = run_example(jax_cache, "train.py", *SMALL, where, "--config.checkpoint.resume=True")
    assert "resumed from step 200" in out
    assert re.search(r"^checkpoint   200 \| restored in [0-9.]+ s$", out, re.M)
    assert "step    50 | loss" not in out  # did not start over
    assert digest(out, "final") == first  # bit-identical to the uninterrupted run

    out = run_example(jax_cache, "serve.py", *SMALL, where)
    accuracy = float(re.search(r"held-out accuracy ([0-9.]+)", out).group(1))
    assert 0.4 < accuracy <= 1.0  # 4 classes: chance is 0.25
    assert digest(out, "served") == first


def test_main_job_kills_resumes_and_matches(tmp_path, jax_cache):
    cmd = [
        sys.executable,
        os.path.join(REPO, "examples", "main_job.py"),
        f"--workdir={tmp_path / 'demo'}",
        "--kill-at=200",
        "--config.num_train_steps=400",
        "--config.batch_size=32",
        "--config.hidden_sizes=(64,64)",
        "--config.log_every_steps=20",
        "--config.checkpoint.every_steps=100",
    ]
    env = _env(jax_cache)  # the main job's five runs, one after another, inherit it
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "sent SIGKILL" in p.stdout and "exit status -9" in p.stdout
    resumed = int(re.search(r"resumed from step (\d+)", p.stdout).group(1))
    killed = int(re.search(r"sent SIGKILL to pid \d+ after step (\d+)", p.stdout).group(1))
    assert 200 <= killed < 400 and 0 < resumed <= killed and resumed % 100 == 0
    assert "PASS" in p.stdout


def test_sigterm_saves_the_step_reached_and_required_refuses_to_start_fresh(tmp_path, jax_cache):
    """A preemption's SIGTERM: the example saves the step it reached and exits 143
    (before, it died of the signal, losing the steps since the last save); and
    --config.checkpoint.resume=required reaches the callback from the command line."""
    ckpt = tmp_path / "ckpt"
    cmd = example_cmd(
        "train.py",
        *SMALL,
        "--config.num_train_steps=100000",
        "--config.checkpoint.every_steps=100000",
        f"--config.checkpoint.directory={ckpt}",
    )
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(jax_cache), stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # a step logged: the loop runs
            if re.match(r"^step\s+100 \| loss", line):
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, rest
    steps = sorted(int(n) for n in os.listdir(ckpt) if n.isdigit())
    assert len(steps) == 1 and steps[0] >= 100, steps  # the step reached, not step 0

    missing = tmp_path / "nothing_here"
    where = f"--config.checkpoint.directory={missing}"
    p = subprocess.run(
        example_cmd("train.py", *SMALL, where, "--config.checkpoint.resume=required"),
        cwd=REPO,
        env=_env(jax_cache),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode != 0 and "resume='required'" in p.stderr, p.stderr[-2000:]
    assert not missing.exists()


def test_the_first_documented_command_on_a_directory_holding_a_run_says_so_in_one_line(
    tmp_path, jax_cache
):
    """After `make demo` the README's first command (train.py with the default config,
    resume False) met the demo's steps in its default directory: a 28-line traceback.
    Now one line in the script's own flags, exit 1, nothing written."""
    ckpt = tmp_path / "ckpt"
    with fop.CheckpointManager(ckpt) as mngr:
        mngr.save(7, {"params": {"w": np.ones(3, np.float32)}})
    cmd = example_cmd("train.py", *SMALL, f"--config.checkpoint.directory={ckpt}")
    p = subprocess.run(
        cmd, cwd=REPO, env=_env(jax_cache), capture_output=True, text=True, timeout=180
    )
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train.py: {ckpt} already holds the steps of a run"), p.stderr
    assert "--config.checkpoint.resume=True" in last and "overwrite=True" in last
    assert sorted(os.listdir(ckpt)) == [".writer.lock", "7"]
