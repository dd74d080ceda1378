"""Pathways (single-controller JAX) is detected and refused naming it (issue 54 item 5).

No Pathways cluster here: a child process runs with ``JAX_PLATFORMS=proxy`` (what
``pathwaysutils`` sets, and how it tells Pathways itself); every public save and
restore entry point must refuse before touching a device or writing a byte.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest
from _proc import child_env

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import host as pathways

CHILD = r"""
import json, os, sys
import numpy as np
import flax_orbax_plugin as fop

d = sys.argv[1]
tree = {"w": np.ones(3, np.float32)}
calls = {
    "save": lambda: fop.save(os.path.join(d, "a"), tree),
    "save_async": lambda: fop.save_async(os.path.join(d, "b"), tree),
    "restore": lambda: fop.restore(os.path.join(d, "c")),
    "restore_params": lambda: fop.restore_params(os.path.join(d, "run")),
    "manager": lambda: fop.CheckpointManager(os.path.join(d, "run")).save(1, {"params": tree}),
    "callback": lambda: fop.CheckpointCallback(
        os.path.join(d, "run2"), every_steps=1).on_train_start({"params": tree}),
}
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = None
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]
out["files"] = sorted(os.listdir(d))
print(json.dumps(out))
"""


def test_every_save_and_restore_refuses_under_pathways(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        env=child_env(JAX_PLATFORMS="proxy"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("files") == []  # nothing written
    for name, (kind, message) in out.items():
        assert kind == "UnsupportedRuntimeError", (name, kind, message)
        assert "Pathways (single-controller JAX) detected" in message, name
        assert "jax_platforms is 'proxy'" in message
        assert "one process per host" in message and "FOP_PATHWAYS=allow" in message


def test_not_detected_here():
    assert pathways.detected() is None
    pathways.refuse_if_detected("save")  # nothing raised


def test_detection_reads_the_platforms_and_allow_lets_it_run(monkeypatch):
    before = jax.config.jax_platforms
    try:
        jax.config.update("jax_platforms", "cpu,proxy")
        assert pathways.detected() == "jax_platforms is 'cpu,proxy'"
        with pytest.raises(fop.UnsupportedRuntimeError, match="save: Pathways"):
            pathways.refuse_if_detected("save")
        monkeypatch.setenv("FOP_PATHWAYS", "allow")
        pathways.refuse_if_detected("save")  # the explicit opt-in
        monkeypatch.setenv("FOP_PATHWAYS", "yes")
        with pytest.raises(fop.OptionError, match="FOP_PATHWAYS"):
            pathways.refuse_if_detected("save")
    finally:
        jax.config.update("jax_platforms", before)
    assert pathways.detected() is None
