"""Thread priority confined to the library's own threads; every FOP_* variable checked
where it is read (issue 32).

A child process with ``FOP_BACKGROUND_NICE=10`` saves in every format and mode whose
writers may lower themselves (version 1 and 2, compressed, an incremental manager, a
persistent tier); afterwards every thread of the process (tensorstore's workers
included) and a plain thread started from the main thread have the nice value the
process started with (``os.getpriority`` on each thread's tid).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import env as _env

CHILD = r"""
import os, sys, threading
import numpy as np
import flax_orbax_plugin as fop

def nice(tid):
    return os.getpriority(os.PRIO_PROCESS, tid)

start = nice(threading.get_native_id())
root = sys.argv[1]
tree = {f"w{i}": np.full((256, 256), i, np.float32) for i in range(4)}
tree["small"] = np.ones(3)
fop.save(root + "/v2z", tree, format_version=2, compression="zstd")
fop.save(root + "/v1", tree)
fop.save(root + "/v1z", tree, compression="zstd")
fop.save(root + "/v2", tree, format_version=2)
with fop.CheckpointManager(root + "/m2", incremental=True, format_version=2) as m:
    m.save(1, {"params": tree})
    m.save(2, {"params": tree})
with fop.CheckpointManager(root + "/m", incremental=True, persistent=root + "/p") as m:
    m.save(1, {"params": tree})
    m.save(2, {"params": tree})
    m.persistent.wait()
fop.restore(root + "/v2z")
seen = []
t = threading.Thread(target=lambda: seen.append(nice(threading.get_native_id())))
t.start(); t.join()
others = {}
for tid in os.listdir("/proc/self/task"):
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            others[f"{f.read().strip()}/{tid}"] = nice(int(tid))
    except OSError:
        pass
lowered = sorted(k for k, v in others.items() if v != start)
print("START", start, "PLAIN", seen[0], "LOWERED", lowered)
"""


def test_threads_started_after_a_lowered_save_keep_the_process_priority(tmp_path):
    env = _proc.child_env(FOP_BACKGROUND_NICE="10")
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("START")][-1]
    start, plain, lowered = line.split(" ", 5)[1], line.split()[3], line.split("LOWERED ", 1)[1]
    assert int(start) < 10
    assert plain == start
    assert lowered == "[]", lowered  # tensorstore's workers were lowered: ts_pool_worker/...


def test_lowering_still_applies_to_the_local_chunk_writers(monkeypatch):
    monkeypatch.setenv("FOP_BACKGROUND_NICE", "10")
    assert _env.initializer(local_only=True) is _env.lower
    assert _env.initializer(local_only=False) is None  # a store's client: not lowered


BAD = [
    ("FOP_BACKGROUND_NICE", "abc", "an int >= 0 and <= 19"),
    ("FOP_BACKGROUND_NICE", "20", "an int >= 0 and <= 19"),  # was clamped to 19
    ("FOP_BACKGROUND_NICE", "-3", "an int >= 0 and <= 19"),  # was clamped to 0
    ("FOP_BACKGROUND_NICE", "2.5", "an int"),
    ("FOP_DIRECT_IO", "off", "one of '0', '1'"),  # was: on (only "0" turned it off)
    ("FOP_KILL_AT", "after_snapshot:0", "its N-th hit, N >= 1"),
    ("FOP_KILL_AT", "after_snapshot:x", "a kill point"),
    ("FOP_FAIL_AT", "read_chunk:1:ENOPE", "ERRNO an errno name"),  # was: EIO silently
    ("FOP_FAIL_AT", "read_chunk:two", "a fail point"),
]


@pytest.mark.parametrize("name, value, expected", BAD)
def test_a_bad_environment_value_is_refused_by_a_save(tmp_path, monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    with pytest.raises(fop.OptionError, match=rf"environment variable {name} must be") as info:
        fop.save(tmp_path / "c", {"w": np.zeros((64, 1024), np.float32)})
    assert expected in str(info.value) and repr(value) in str(info.value)


AT_IMPORT = [
    *[("FOP_COORDINATION_TIMEOUT_S", v, "a number of seconds > 0") for v in ("nan", "-5", "1e300")],
    ("FOP_PEER_SILENT_S", "0.1", "a number of seconds >= 0.5 and <= 3600"),
    ("FOP_LATE_REPORT_S", "soon", "a number of seconds >= 0.5"),
]


@pytest.mark.parametrize("name, value, expected", AT_IMPORT)
def test_a_bad_coordination_timeout_is_refused_at_import(name, value, expected):
    # The package loads its API on first use (its __getattr__): touch a public name.
    run = subprocess.run(
        [sys.executable, "-c", "import flax_orbax_plugin as fop; fop.save"],
        env=_proc.child_env(**{name: value}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert f"environment variable {name} must be {expected}" in run.stderr, run.stderr[-2000:]
    assert repr(value) in run.stderr


def test_every_fop_variable_the_package_reads_is_declared():
    root = os.path.dirname(fop.__file__)
    named = set()
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    text = f.read()
                assert not re.search(r"environ[^\n]*FOP_", text), f"{name} reads FOP_* itself"
                named.update(re.findall(r"[\"'](FOP_[A-Z_]+)[\"']", text))
    assert named and named <= set(_env.VARIABLES), named - set(_env.VARIABLES)


def test_good_values_are_taken(monkeypatch):
    monkeypatch.setenv("FOP_BACKGROUND_NICE", " 7 ")
    monkeypatch.setenv("FOP_FAIL_AT", "read_chunk:2:EMFILE")
    monkeypatch.delenv("FOP_DIRECT_IO", raising=False)
    assert _env.read("FOP_BACKGROUND_NICE") == 7
    assert _env.read("FOP_FAIL_AT")[:3] == ("read_chunk", 2, "EMFILE")
    assert _env.read("FOP_DIRECT_IO") == "1"


def test_a_bad_tier_retry_delay_is_refused_at_a_tiers_open(tmp_path):
    """FOP_TIER_RETRY_DELAY_S is read once, when a manager with a persistent tier is
    first opened in the process: a bad value is refused there, by name."""
    code = "import sys, flax_orbax_plugin as fop\n"
    code += "fop.CheckpointManager(sys.argv[1], persistent=sys.argv[2])"
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "local"), str(tmp_path / "remote")],
        env=_proc.child_env(FOP_TIER_RETRY_DELAY_S="-1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    expected = "environment variable FOP_TIER_RETRY_DELAY_S must be a finite number >= 0"
    assert expected in run.stderr and "'-1'" in run.stderr, run.stderr[-2000:]
