"""The command line as a shell runs it (real child processes): a reader that closes the
pipe early (``| head -1``) costs neither the command's work nor its exit status, and a
SIGTERM interrupts an export as Ctrl-C does (its temporary file removed, exit 143)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import _proc
import numpy as np

import flax_orbax_plugin as fop


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "flax_orbax_plugin", *map(str, args)]


def _run_with_closed_stdout(*commands: tuple) -> list[tuple[int, str]]:
    """Runs the commands side by side, each with a stdout pipe its reader has already
    closed: every write meets EPIPE (as ``| head -1`` once head is done)."""
    procs = []
    for args in commands:
        read, write = os.pipe()
        os.close(read)
        try:
            procs.append(
                subprocess.Popen(
                    _cli(*args), stdout=write, stderr=subprocess.PIPE, env=_proc.child_env()
                )
            )
        finally:
            os.close(write)
    return [(p.wait(timeout=120), p.stderr.read().decode()) for p in procs]


def test_a_closed_pipe_costs_neither_the_work_nor_the_exit_status(tmp_path):
    run = tmp_path / "run"
    with fop.CheckpointManager(run, async_save=False) as m:
        for step in range(1, 6):
            m.save(step, {"params": {"w": np.full(3, step, np.float32)}})
    reads = [(command, run) for command in ("list", "inspect", "verify")]
    for (command, _), (code, err) in zip(reads, _run_with_closed_stdout(*reads), strict=True):
        assert code == 0 and "Broken pipe" not in err, (command, code, err)
    [(code, err)] = _run_with_closed_stdout(("gc", run, "--keep", "2"))
    assert code == 0 and "Broken pipe" not in err, err
    assert sorted(int(p.name) for p in run.iterdir() if p.name.isdigit()) == [4, 5]
    (run / "5" / "_CHECKPOINT.json").write_bytes(b"{}")  # damage still exits 1
    [(code, err)] = _run_with_closed_stdout(("verify", run, "--all"))
    assert code == 1, err


def test_sigterm_during_an_export_removes_its_temporary_file(tmp_path):
    fop.save(tmp_path / "ckpt", {"a": np.ones((64, 64), np.float32), "b": np.zeros(8)})
    out = tmp_path / "out"
    out.mkdir()
    env = _proc.child_env(FOP_PAUSE_AT="export_write", FOP_PAUSE_S="30", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        _cli("export", tmp_path / "ckpt", out / "model.safetensors"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        err = b""
        while b"FOP_PAUSED" not in err:  # paused with its temporary file open
            assert time.monotonic() < deadline and proc.poll() is None, err
            err += os.read(proc.stderr.fileno(), 4096)
        assert any(".tmp-" in name for name in os.listdir(out)), os.listdir(out)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err += rest
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    assert b"terminated" in err
    assert os.listdir(out) == [], os.listdir(out)


def test_ctrl_c_while_the_commands_load_is_an_interruption(tmp_path):
    """SIGINT while JAX loads (the first second or so) was a raw 'ImportError:
    initialization failed' (exit 2), or was swallowed by a garbage-collection callback
    and the command ran on to exit 0. Now it is 'interrupted', exit 130, at any moment.
    Sent once the handlers exist (``_catches``), at once and half a second into the
    loading of an export (`list` loads no JAX: it is done before a fixed delay)."""
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    for delay in (0.0, 0.5):
        out = tmp_path / f"out-{delay}.safetensors"
        proc = subprocess.Popen(
            _cli("export", str(tmp_path / "run"), out),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_proc.child_env(),
        )
        # SIGTERM's handler (Python catches SIGINT from its start): the command's own
        # handlers are both set, SIGINT's first
        _catches(proc.pid, signal.SIGTERM)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, (delay, proc.returncode, err[-2000:])
        assert err.strip().splitlines()[-1].startswith("flax-orbax export: interrupted"), err
        assert "Traceback" not in err and "ImportError" not in err, err
        assert not out.exists()


def _catches(pid: int, signum: int, timeout: float = 60.0) -> None:
    """Waits until process ``pid`` has a handler for ``signum`` (its ``SigCgt`` mask in
    /proc): the command's first act, so a signal sent after it lands while the command
    loads, however slowly the machine starts it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line for line in f if line.startswith("SigCgt:")).split()[1]
        if int(mask, 16) >> (signum - 1) & 1:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} took no handler for signal {signum} in {timeout} s")


def test_sigterm_while_the_commands_load_is_a_termination(tmp_path):
    """SIGTERM while JAX loads was a raw 'error: ImportError: initialization failed'
    (exit 2); SIGTERM acts as Ctrl-C does: 'terminated', exit 143, at any moment. Each
    signal is sent once the command's handler exists (a fixed delay could land before
    it, on a loaded machine): at once, and half a second into the loading of an export
    (which loads JAX, for seconds)."""
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    procs = {}  # two commands side by side, signalled at two moments of their loading
    for delay in (0.0, 0.5):
        out = tmp_path / f"out-{delay}.safetensors"
        procs[delay] = subprocess.Popen(
            _cli("export", str(tmp_path / "run"), out),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_proc.child_env(),
        )
    for delay, proc in procs.items():
        _catches(proc.pid, signal.SIGTERM)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
    for delay, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, (delay, proc.returncode, err[-2000:])
        assert err.strip().splitlines()[-1].startswith("flax-orbax export: terminated"), err
        assert "Traceback" not in err and "ImportError" not in err, err
        assert not (tmp_path / f"out-{delay}.safetensors").exists()


def test_a_shell_commands_warnings_are_its_own_lines(tmp_path):
    """A library warning came out as Python's '<frozen runpy>:88: UserWarning: ...'."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        state = {"w": np.ones(3, np.float32)}
        mngr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        mngr.wait_until_finished()
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    proc = subprocess.run(
        _cli("import", tmp_path / "orbax", tmp_path / "run"),
        capture_output=True,
        text=True,
        env=_proc.child_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "flax-orbax import: warning: " in proc.stderr and "already holds steps 1" in proc.stderr
    assert "UserWarning" not in proc.stderr and "runpy" not in proc.stderr, proc.stderr


def _run_with_closed(fd: int, *args) -> subprocess.CompletedProcess:
    """The command with descriptor ``fd`` (1: stdout, 2: stderr) closed, as ``>&-`` or
    ``2>&-`` leaves it; the other one captured."""
    return subprocess.run(
        ["sh", "-c", f'exec "$@" {fd}>&-', "sh", *_cli(*args)],
        stdout=subprocess.PIPE if fd != 1 else None,
        stderr=subprocess.PIPE if fd != 2 else None,
        text=True,
        env=_proc.child_env(),
        timeout=120,
    )


def test_a_closed_stdout_or_stderr_drops_the_lines_not_the_work(tmp_path):
    """``>&-`` ended in "error: AttributeError: 'NoneType' object has no attribute
    'write'", a traceback and exit 120; ``2>&-`` sent the error and warning lines to
    stdout, into the --json document."""
    run = tmp_path / "run"
    with fop.CheckpointManager(run, async_save=False) as m:
        for step in range(1, 6):
            m.save(step, {"params": {"w": np.full(3, step, np.float32)}})
    for args in (("list", run), ("gc", run, "--keep", "2")):
        proc = _run_with_closed(1, *args)
        assert proc.returncode == 0 and proc.stderr == "", (args, proc.returncode, proc.stderr)
    assert sorted(int(p.name) for p in run.iterdir() if p.name.isdigit()) == [4, 5]

    proc = _run_with_closed(2, "list", tmp_path / "nothing", "--json")
    assert (proc.returncode, proc.stdout) == (2, "")
    with fop.CheckpointManager(run):  # a live writer: gc --dry-run warns that gc would refuse
        proc = _run_with_closed(2, "gc", run, "--keep", "1", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout)["removed_steps"] == [4]


def test_a_command_started_ignoring_ctrl_c_keeps_ignoring_it(tmp_path):
    """A script's background job (``flax-orbax gc DIR &``) starts with SIGINT ignored,
    so that the Ctrl-C stopping the script does not stop it (Python leaves it so); the
    command installed its own handler over that and exited 130 'interrupted'."""
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    proc = subprocess.Popen(  # SIGINT ignored as `cmd &` in a script leaves it
        ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *_cli("list", tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_proc.child_env(),
    )
    time.sleep(0.5)  # while it loads (a signal then is held, then raised)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "interrupted" not in err, (proc.returncode, err[-2000:])
    assert "1 step(s)" in out, out
