"""Progress bars: drawn by rich on a real pseudo-terminal (bytes done of the total,
rate, time left) for verify, export and import, a spinner for gc; nothing on a pipe."""

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import _paths
import numpy as np
import pytest
from flax import serialization

import flax_orbax_plugin as fop

REPO = _paths.REPO

# One child runs the three commands (one JAX import); stderr is the terminal or a pipe.
CHILD = """
import sys
from flax_orbax_plugin import cli
ckpt, msgpack_file, work = sys.argv[1], sys.argv[2], sys.argv[3]
codes = [
    cli.main(["verify", ckpt]),
    cli.main(["export", ckpt, work + "/p.safetensors"]),
    cli.main(["import", msgpack_file, work + "/imported"]),
    cli.main(["gc", work + "/imported", "--keep", "1"]),
]
print("codes", codes, flush=True)
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A run directory of one step with 4 MiB of params, and a msgpack file of 2 MiB."""
    work = tmp_path_factory.mktemp("progress")
    params = {"w": np.arange(1 << 20, dtype=np.float32), "b": np.ones(7, np.float32)}
    with fop.CheckpointManager(work / "run") as mngr:
        mngr.save(3, {"params": params})
    state = {"params": {"k": np.ones((512, 1024), np.float32)}}
    (work / "checkpoint_7").write_bytes(serialization.to_bytes(state))
    return work


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    env.update(TERM="xterm-256color", COLUMNS="160", LINES="40")
    env["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def _run(sources, out, *, terminal: bool):
    """(stdout, stderr as bytes) of the child, its stderr a pseudo-terminal or a pipe."""
    argv = [sys.executable, "-c", CHILD, str(sources / "run"), str(sources / "checkpoint_7")]
    argv.append(str(out))
    if not terminal:
        p = subprocess.run(argv, env=_env(), capture_output=True, timeout=240)
        assert p.returncode == 0, p.stderr.decode(errors="replace")
        return p.stdout.decode(), p.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 240)
            if not ready:
                raise AssertionError(f"no output from the child in 240 s: {seen[-2000:]!r}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
        stdout = proc.stdout.read().decode()
        proc.wait(timeout=60)
    assert proc.returncode == 0, seen.decode(errors="replace")
    return stdout, seen


def _plain(raw: bytes) -> str:
    """The terminal's text without escape sequences."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace"))


def test_bars_on_a_terminal_show_bytes_rate_and_time_left(sources, tmp_path):
    stdout, raw = _run(sources, tmp_path, terminal=True)
    assert "codes [0, 0, 0, 0]" in stdout
    text = _plain(raw)
    for label, total in (
        ("verify step 3/params", "4.0/4.0 MiB"),
        ("export", "4.0/4.0 MiB"),
        ("import", "2.0/2.0 MiB"),
    ):
        lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.startswith(label)]
        assert lines, f"no {label!r} bar in {text[-3000:]!r}"
        done = [ln for ln in lines if total in ln]  # bytes done / total
        assert done, (label, lines)
        assert re.search(r"(\d+(\.\d+)? [kKMG]?i?B/s|\?)", done[-1]), done[-1]  # the rate
        times = re.findall(r"\d+:\d\d:\d\d|-:--:--", done[-1])
        assert len(times) == 2, done[-1]  # time taken, time left
    assert "\x1b[" in raw.decode(errors="replace")  # drawn with terminal controls
    assert f"gc {tmp_path / 'imported'}" in text  # gc: a spinner (no byte counts)


def test_a_pipe_gets_no_bar(sources, tmp_path):
    stdout, err = _run(sources, tmp_path, terminal=False)
    assert "codes [0, 0, 0, 0]" in stdout
    assert b"\r" not in err and b"\x1b" not in err and b"MiB" not in err, err[-2000:]
