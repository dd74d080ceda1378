"""Child processes in tests, bounded: every read of a child's output has a deadline.

* :func:`child_env` is the environment for a Python child that must import this
  checkout's package (the repository root first on PYTHONPATH, wherever the tests
  are run from).
* :func:`read_line` returns the child's next stdout line, or fails the test when
  none arrives within ``timeout`` seconds (or the child exits first); it never
  blocks past the deadline.
* :func:`compile_cache_env` lets children run one after another compile the same
  JAX programs once (the persistent compilation cache).
* :func:`wait` waits for the child's exit with a deadline, SIGKILLing it on expiry.
* :func:`sigterm_after` reads the step numbers a training child prints until one
  reaches a bound, then SIGTERMs it and collects the rest of its output.
* :func:`run_as_a_user` runs a Python child with the permissions of files holding
  (root drops the capabilities that ignore them); :func:`permissions_can_hold` says
  whether that is possible here.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import time

import _paths

REPO = _paths.REPO


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a test's child process: this checkout's package and the shared
    test helpers (tests/support) importable, unbuffered output, plus ``extra``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [REPO, _paths.SUPPORT, os.environ.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.update(extra)
    return env


def compile_cache_env(directory: object) -> dict[str, str]:
    """Environment that makes a JAX child keep every program it compiles in ``directory``
    (JAX's persistent compilation cache, no minimum time or size) and load it from there
    in the next child that compiles the same program: children that run the same training
    code one after another compile it once. Give it to children that run one at a time:
    JAX writes an entry in place, so a child reading it while another writes it would see
    half a file (a warning, and a compile)."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(directory),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def permissions_can_hold() -> bool:
    """Whether a file's permissions can shut a child out here (root needs setpriv)."""
    return os.geteuid() != 0 or shutil.which("setpriv") is not None


def run_as_a_user(*args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python *args`` with the permissions of files holding: as root, with the
    capabilities that ignore them dropped (setpriv); the checkout's package first."""
    command = [sys.executable, *map(str, args)]
    if os.geteuid() == 0:
        drop = "-dac_override,-dac_read_search,-fowner"
        command = ["setpriv", "--inh-caps", drop, "--bounding-set", drop, *command]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line the child prints (without its newline); fails after ``timeout`` s.

    The child's stdout must be a pipe opened in text mode. Reads one byte at a time
    once the pipe is readable, so nothing past the line is buffered away.
    """
    import pytest

    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    chunks: list[bytes] = []
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(
                    f"child {proc.pid} printed no line within {timeout} s "
                    f"(so far: {b''.join(chunks)!r})"
                )
            if not sel.select(left):
                continue
            byte = os.read(fd, 1)
            if not byte:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                pytest.fail(
                    f"child {proc.pid} exited ({code}) before printing a line "
                    f"(so far: {b''.join(chunks)!r})"
                )
            if byte == b"\n":
                return b"".join(chunks).decode()
            chunks.append(byte)


def wait(proc: subprocess.Popen, timeout: float) -> int:
    """The child's exit code; SIGKILLs it and fails the test if it runs past ``timeout``."""
    import pytest

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        pytest.fail(f"child {proc.pid} still running after {timeout} s; killed")


def sigterm_after(proc: subprocess.Popen, step: int, timeout: float = 120) -> list[str]:
    """Reads the integers the child prints (one per line) until one is ``>= step``,
    sends SIGTERM and returns the words it printed afterwards; the child is killed
    whatever happens (its exit code is then ``proc.returncode``)."""
    try:
        while int(read_line(proc, timeout=timeout)) < step:
            pass
        proc.send_signal(signal.SIGTERM)
        return proc.communicate(timeout=timeout)[0].split()
    finally:
        proc.kill()


def run_two_programs(
    command: list[str], args: list[str], env: dict[str, str], timeout: float
) -> list[tuple[str, str]]:
    """Runs ``command + [port, process index] + args`` as processes 0 and 1 of one
    jax.distributed run on a free port (``env`` without pytest's variables, on the
    CPU); returns each one's ``(stdout, stderr)`` once both ended (both killed after
    ``timeout`` seconds)."""
    from _multiprocess import free_port

    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_")}
    env["JAX_PLATFORMS"] = "cpu"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [*command, port, str(i), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in (0, 1)
    ]
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
