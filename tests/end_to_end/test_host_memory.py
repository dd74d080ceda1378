"""One host-memory ceiling on every path that moves data (issue 53): each path's peak
resident memory, measured in a child process (the kernel's VmHWM, reset before each
path), stays within the ceiling plus a stated constant, on a state eight times the
ceiling, so holding the whole state (or one copy of it) could not pass. A control path
(a manager keeping a pooled host copy) shows that the measure sees a whole state.

Paths: fop.save (host_memory_budget), a manager's save and restore (host_memory),
a callback's resume (host_memory), restore_params and fop.restore
(memory_limit_bytes), to_safetensors and `flax-orbax export --memory-limit`, and
import_msgpack / `flax-orbax import --memory-limit` (a file larger than the ceiling
allows is refused with the figure, before anything is read or written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CHILD = os.path.join(ROOT, "tests", "support", "_host_memory_child.py")
STATE_MIB = 256
CEILING = 32 << 20  # 1/8 of the state
SLACK = 16 << 20  # the stated constant: interpreter, tensorstore and allocator noise

PATHS = [
    "save",
    "manager_save",
    "restore",
    "manager_restore",
    "resume",
    "serve",
    "export",
    "cli_export",
    "import",
    "cli_import",
    "pooled_save",
    "hundred_saves",
    "hundred_device_saves",
]


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's peak reset (/proc/self/clear_refs)")
    directory = tmp_path_factory.mktemp("host_memory")
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one device: the state is one shard per leaf
    args = [sys.executable, CHILD, str(directory), str(CEILING), str(STATE_MIB), ",".join(PATHS)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :]), directory


@pytest.mark.parametrize(
    "path",
    [
        "save",
        "manager_save",
        "restore",
        "manager_restore",
        "resume",
        "serve",
        "export",
        "cli_export",
    ],
)
def test_each_path_stays_within_the_ceiling(peaks, path):
    figures, _ = peaks
    got = figures[path]
    assert got["error"] is None, got["error"]
    assert figures["state_bytes"] >= 8 * CEILING
    assert got["extra"] <= CEILING + SLACK, (
        f"{path}: held {got['extra'] / 2**20:.1f} MiB beyond the state and its result, "
        f"ceiling {CEILING / 2**20:.0f} MiB + {SLACK / 2**20:.0f} MiB"
    )


def test_the_measure_sees_a_whole_state_held(peaks):
    # The control: a manager asked to keep a host copy (reuse_host_buffers=True) holds
    # the state's bytes; a measure that missed it would pass any path.
    figures, _ = peaks
    assert figures["pooled_save"]["extra"] >= figures["state_bytes"] * 3 // 4


def test_an_import_larger_than_the_ceiling_is_refused_with_the_figure(peaks):
    figures, directory = peaks
    size = os.path.getsize(directory / "state.msgpack")
    error = figures["import"]["error"]
    assert error is not None and error.startswith("OptionError: memory_limit_bytes=33554432")
    assert f"hold {2 * size} bytes" in error and f">= {2 * size}" in error
    assert figures["import"]["extra"] <= SLACK  # refused before reading the file
    assert figures["cli_import"]["error"] == "exit status 2"  # the CLI's error
    for out in ("imp", "imp2"):  # nothing written, nothing created
        assert not os.path.exists(directory / out)


@pytest.mark.parametrize("name", ["hundred_saves", "hundred_device_saves"])
def test_resident_memory_is_flat_over_100_saves_with_the_defaults(peaks, name):
    # Nothing kept between saves unless asked (reuse_host_buffers=False by default), and
    # the accelerator's staging (its device copy and fetched regions) given back: the
    # resident memory after the 100th save is that after the 10th (no growth, no leak).
    figures, _ = peaks
    assert figures[name]["error"] is None, figures[name]["error"]
    rss = figures[f"{name}_rss"]
    assert len(rss) == 100
    assert rss[-1] - rss[9] <= 8 << 20, [r >> 20 for r in rss[::10]]
