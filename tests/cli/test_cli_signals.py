"""Ctrl-C and SIGTERM of a shell's command, whatever their number and moment (real
child processes, real signals): one line on stderr, no traceback, and 130 when the
first was SIGINT, 143 when it was SIGTERM; what the command was writing is removed.

The moments are made exact: an export is slowed (``FOP_SLOW_AT``) so that the first
signal lands while it writes, and paused in its clean-up (``FOP_PAUSE_AT``) so that the
second lands there; an import hook sends the signal while the package loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop

SIGINT, SIGTERM = signal.SIGINT, signal.SIGTERM


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "flax_orbax_plugin", *map(str, args)]


def _wait_for(proc, predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the command ended before {what}: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.01)


def _one_line(err: str, command: str, what: str) -> None:
    lines = [line for line in err.splitlines() if not line.startswith("FOP_PAUSED")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"flax-orbax {command}: {what}"), err


@pytest.mark.parametrize("second", [SIGINT, SIGTERM], ids=["ctrl-c-twice", "ctrl-c-then-sigterm"])
def test_a_second_signal_during_the_clean_up_is_one_line_and_removes_everything(tmp_path, second):
    """A SIGTERM after a Ctrl-C raised a raw traceback (Terminated, raised while main
    printed 'interrupted') and exit 1; a second Ctrl-C a raw KeyboardInterrupt or a death
    by the signal, and cut the export's clean-up short: its temporary files stayed."""
    fop.save(tmp_path / "ckpt", {f"w{i}": np.full((64, 64), i, np.float32) for i in range(8)})
    out = tmp_path / "out"
    env = _proc.child_env(
        FOP_SLOW_AT="export_write", FOP_SLOW_S="0.3", FOP_PAUSE_AT="export_discard",
        FOP_PAUSE_S="1", JAX_PLATFORMS="cpu",
    )  # fmt: skip
    proc = subprocess.Popen(
        _cli("export", tmp_path / "ckpt", out, "--max-shard-size", "20KB"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(proc, lambda: out.is_dir() and any(".tmp-" in n for n in os.listdir(out)),
                  "temporary file")  # fmt: skip
        proc.send_signal(SIGINT)
        seen = ""
        while "FOP_PAUSED export_discard" not in seen:  # cleaning up, its files there
            assert proc.poll() is None, seen
            seen += proc.stderr.readline()
        assert any(".tmp-" in n for n in os.listdir(out)), os.listdir(out)
        proc.send_signal(second)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, seen + err)
    _one_line(seen + err, "export", "interrupted")
    assert not out.exists() or os.listdir(out) == [], os.listdir(out)


@pytest.mark.parametrize("first, code", [(SIGINT, 130), (SIGTERM, 143)], ids=["int", "term"])
def test_a_signal_after_the_interruption_was_reported_changes_nothing(tmp_path, first, code):
    """Signals keep coming (a second, a third, of either kind) from the moment the first
    interrupts the command until it has exited: still one line and the first's status,
    never a traceback or a death by the signal."""
    fop.save(tmp_path / "ckpt", {"w": np.ones((64, 64), np.float32)})
    env = _proc.child_env(FOP_PAUSE_AT="export_write", FOP_PAUSE_S="30", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        _cli("export", tmp_path / "ckpt", tmp_path / "out.safetensors"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = ""
        while "FOP_PAUSED" not in seen:
            assert proc.poll() is None, seen
            seen += proc.stderr.readline()
        proc.send_signal(first)
        _taken(proc.pid, first)  # else both pending: Python runs SIGINT's handler first
        time.sleep(0.2)  # delivered; its Python handler runs as the paused sleep wakes
        for other in [SIGTERM, SIGINT] * 25:  # for a quarter of a second and more
            if proc.poll() is not None:
                break
            proc.send_signal(other)
            time.sleep(0.01)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, (proc.returncode, seen + err)
    _one_line(seen + err, "export", "interrupted" if first == SIGINT else "terminated")
    assert os.listdir(tmp_path) == ["ckpt"], os.listdir(tmp_path)


def _taken(pid: int, signum: int, timeout: float = 10.0) -> None:
    """Waits until ``signum`` is no longer pending for process ``pid`` (its handler ran),
    reading /proc (the signal masks of the process and of its threads)."""
    bit = 1 << (int(signum) - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                masks = [ln.split()[1] for ln in f if ln.startswith(("SigPnd:", "ShdPnd:"))]
        except OSError:
            return  # gone: it has handled it (or died of it: the test says so)
        if not any(int(m, 16) & bit for m in masks):
            return
        time.sleep(0.005)


# The console script's statements, with a signal sent to itself when a module is first
# imported: the moment that module loads, exactly.
_SIGNAL_ON_IMPORT = """
import os, signal, sys
MODULE, SIGNUM = sys.argv[1], int(sys.argv[2])
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), SIGNUM)
        return None
sys.meta_path.insert(0, Hook())
sys.argv = ["flax-orbax", *sys.argv[3:]]
from flax_orbax_plugin.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("signum, code", [(SIGINT, 130), (SIGTERM, 143)], ids=["int", "term"])
def test_a_signal_while_the_package_itself_loads_is_one_line(tmp_path, signum, code):
    """A Ctrl-C in the first tenth of a second, while the package's own modules load
    (the command's among them, once the command holds Ctrl-C), is one line (it was a
    raw traceback when the package's import read its version before that)."""
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    p = subprocess.run(
        [sys.executable, "-c", _SIGNAL_ON_IMPORT, "flax_orbax_plugin.cli.list_command",
         str(int(signum)), "list", str(tmp_path / "run")],
        env=_proc.child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    _one_line(p.stderr, "list", "interrupted" if signum == SIGINT else "terminated")


def test_a_signal_after_the_work_says_it_came_too_late(tmp_path):
    """A Ctrl-C once the command had done its work, as the process exits: no line, a
    raw KeyboardInterrupt traceback and a death by the signal."""
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    code = (
        "import os, signal, sys, time\n"
        "from flax_orbax_plugin.cli import main\n"
        f"sys.argv = ['flax-orbax', 'list', {str(tmp_path / 'run')!r}]\n"
        "status = main()\n"
        "os.kill(os.getpid(), signal.SIGINT)  # as the process exits\n"
        "time.sleep(1)\n"
        "sys.exit(status)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=_proc.child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 130, (p.returncode, p.stderr[-2000:])
    _one_line(p.stderr, "list", "interrupted, too late to stop it")
    assert p.stdout.strip(), "the listing itself was printed"
