"""The main job (`make demo`): train, get SIGKILLed mid-run, resume, serve, compare.

1. An uninterrupted reference run trains to the end.
2. The same run is started again with checkpoints and
   `--config.checkpoint.resume=True` (the preemptible-job idiom: resume when steps
   exist, start fresh when none); once it has logged step `--kill-at` and a step
   is committed on disk, this script sends it SIGKILL (a real kill of the real
   process; waiting for a commit keeps a slow machine's demo from killing a run
   that has nothing to resume yet).
3. It is restarted with the very same command and finishes from its latest step.
4. examples/serve.py restores the params alone and scores held-out data.
5. The final params of the resumed run, of the served checkpoint and of the
   reference run must be equal bit for bit (sha256 over every leaf's bytes).

Exits non-zero if any of that does not hold.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "default.py")
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss")
DIGEST_LINE = re.compile(r"^(final|served) params sha256 ([0-9a-f]{64})$")


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def _committed_steps(directory):
    """The steps of `directory` that hold their manifest (FORMAT.md: a step is committed
    once its `_CHECKPOINT.json` exists), without importing the library here."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        int(n)
        for n in names
        if n.isdigit() and os.path.isfile(os.path.join(directory, n, "_CHECKPOINT.json"))
    )


def _run(name, cmd, *, kill_at=None, committed_in=None):
    """Runs `cmd`, echoing its output prefixed with [name]; returns (returncode, lines,
    the step after which it was killed or None).

    With `kill_at`, SIGKILLs the process as soon as it logs a step >= kill_at and (with
    `committed_in`) that directory holds a committed step.
    """
    shown = [os.path.relpath(cmd[0]) if os.path.isabs(cmd[0]) else cmd[0]] + cmd[1:]
    print("$ " + " ".join(shown).replace(ROOT + os.sep, ""), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("JAX_PLATFORMS", "cpu")  # CPU is what the demo promises to reproduce.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, killed = [], None
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        print(f"[{name}] {line}", flush=True)
        m = STEP_LINE.match(line)
        due = kill_at is not None and killed is None and m and int(m.group(1)) >= kill_at
        if due and (committed_in is None or _committed_steps(committed_in)):
            os.kill(proc.pid, signal.SIGKILL)
            killed = int(m.group(1))
            print(f"[{name}] >>> sent SIGKILL to pid {proc.pid} after step {m.group(1)}")
    return proc.wait(), lines, killed


def _digest(lines, kind):
    for line in lines:
        m = DIGEST_LINE.match(line)
        if m and m.group(1) == kind:
            return m.group(2)
    return None


def _fail(msg: str) -> None:
    print(f"\nFAIL: {msg}", flush=True)
    sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Further --config.* flags are passed to train.py and serve.py.",
    )
    parser.add_argument("--workdir", default=os.path.join(ROOT, "runs", "demo"))
    parser.add_argument("--kill-at", type=int, default=1300, help="SIGKILL after this step")
    args, overrides = parser.parse_known_args()
    if any(not o.startswith("--config.") for o in overrides):
        parser.error(f"unknown arguments (only --config.* overrides pass through): {overrides}")
    args.overrides = overrides

    t_start = time.perf_counter()
    shutil.rmtree(args.workdir, ignore_errors=True)
    reference_dir = os.path.join(args.workdir, "reference")
    ckpt_dir = os.path.join(args.workdir, "checkpoints")
    train = [sys.executable, os.path.join(ROOT, "examples", "train.py"), f"--config={CONFIG}"]
    train += list(args.overrides)
    cli = [sys.executable, "-m", "flax_orbax_plugin"]

    _banner("1/5 reference: an uninterrupted run")
    rc, lines, _ = _run("reference", [*train, f"--config.checkpoint.directory={reference_dir}"])
    reference = _digest(lines, "final")
    if rc != 0 or reference is None:
        _fail(f"the reference run failed (exit {rc})")

    _banner(f"2/5 the same run, SIGKILLed once it logs step {args.kill_at}")
    # One command for the first start and every restart: resume=True starts fresh
    # when the directory holds no step yet.
    job_cmd = [
        *train,
        f"--config.checkpoint.directory={ckpt_dir}",
        "--config.checkpoint.resume=True",
    ]
    rc, lines, killed_at = _run("train", job_cmd, kill_at=args.kill_at, committed_in=ckpt_dir)
    if rc != -signal.SIGKILL:
        _fail(f"the run was meant to die by SIGKILL but exited with {rc}; lower --kill-at")
    print(f"killed: exit status {rc} (SIGKILL). What survived on disk:")
    subprocess.run([*cli, "list", ckpt_dir], cwd=ROOT, check=False)

    _banner("3/5 the same command again: --config.checkpoint.resume=True resumes")
    rc, lines, _ = _run("resume", job_cmd)
    final = _digest(lines, "final")
    resumed_from = [
        int(m.group(1)) for m in map(re.compile(r"resumed from step (\d+)").search, lines) if m
    ]
    if rc != 0 or final is None:
        _fail(f"the resumed run failed (exit {rc})")
    if not resumed_from or not 0 < resumed_from[0] <= killed_at:
        _fail("the resumed run did not resume from a checkpoint written before the kill")

    _banner("4/5 serve: restore the params alone, score held-out data")
    serve = [sys.executable, os.path.join(ROOT, "examples", "serve.py"), f"--config={CONFIG}"]
    rc, lines, _ = _run(
        "serve", [*serve, *args.overrides, f"--config.checkpoint.directory={ckpt_dir}"]
    )
    served = _digest(lines, "served")
    if rc != 0 or served is None:
        _fail(f"serving failed (exit {rc})")

    _banner("5/5 compare final params, bit for bit")
    print(f"reference run (never interrupted)  sha256 {reference}")
    print(f"killed after step {killed_at}, resumed from {resumed_from[0]}  sha256 {final}")
    print(f"served from the checkpoint         sha256 {served}")
    if not reference == final == served:
        _fail("the params differ")
    print(
        f"\nPASS: killed, resumed and served params equal the uninterrupted run's bit for bit "
        f"({time.perf_counter() - t_start:.0f} s)."
    )


if __name__ == "__main__":
    main()
