"""A process that checkpoints plain arrays never imports flax or optax: the package
recognises Flax (NNX, Linen) objects only once their own modules are loaded, so the
first save of a dict does not pay for importing them (seconds on a cold start).
Each case runs in a fresh child process; the time it saves is measured by
benchmarks/bench_first_use.py, not here."""

import json
import os
import subprocess
import sys

import _paths

CHILD = """
import json, sys
import numpy as np
import flax_orbax_plugin as fop

d = sys.argv[1]
tree = {"params": {"w": np.ones(8, np.float32)}, "opt_state": {"mu": np.zeros(8, np.float32)}}
with fop.CheckpointManager(d + "/run") as m:
    m.save(1, tree)
    m.wait()
    m.restore()
fop.restore_params(d + "/run")
fop.save(d + "/one", tree)
fop.restore(d + "/one", tree)
fop.verify(d + "/run")
with fop.CheckpointCallback(d + "/cb", every_steps=1) as cb:
    cb.on_train_start(tree)
    cb.on_step_end(1, tree)
    cb.on_train_end(tree, step=2)
if sys.argv[2] == "nnx":  # a user of NNX: the same calls on a module
    from flax import nnx
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with fop.CheckpointManager(d + "/nnx") as m:
        m.save(1, model)
        m.wait()
        m.restore(like=model)
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "optax"))))
"""


def _loaded(tmp_path, mode):
    env = dict(os.environ, PYTHONPATH=_paths.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_plain_arrays_never_import_flax_or_optax(tmp_path):
    assert _loaded(tmp_path, "plain") == []


def test_an_nnx_module_is_still_recognised_once_the_user_imported_nnx(tmp_path):
    assert "flax.nnx" in _loaded(tmp_path, "nnx")  # and its save and restore ran
