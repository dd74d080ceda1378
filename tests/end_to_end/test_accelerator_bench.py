"""The accelerator benchmark runs on CPU at a small size with the device path switched
on (``--tiny``: ``CPU_AS_DEVICE``), so that CI exercises the script the TPU figures come
from: its loop in fresh processes (the manager's callback here), its save, restore and
params-only restore beside orbax, its 600 small leaves, and its correctness check
(saves under a donating step restored bit for bit), which fails the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _proc
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_accelerator.py")


@pytest.mark.timeout(300)
def test_the_accelerator_benchmark_runs_small_on_cpu_and_checks_its_restores(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT
    # Its processes run one after another and compile the same step: compiled once.
    env.update(_proc.compile_cache_env(tmp_path / "jax_cache"))
    args = [sys.executable, SCRIPT, "--tiny", "--libs", "none,fop-cb"]
    args += ["--dir", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "out" / "accelerator-tiny.json") as f:
        result = json.load(f)
    io = result["io"]
    assert io["errors"] == []
    assert io["donated_saves_bit_for_bit"] == [True] * 6
    assert io["fop_restored_bit_for_bit"] is True
    rows = {r["entry"]: r for r in result["loop"]["rows"]}
    assert rows["fop-cb"]["n"] == 1 and rows["fop-cb"]["blocking_median_s"] > 0
