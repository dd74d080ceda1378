"""A save the program never waits for still commits when the program ends: its last
line, or an exception nobody catches right after the save. Before, the interpreter's
thread pools stopped under the running save, which failed silently: the step was lost.
A real second process each time (the interpreter's own exit is what is tested)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import flax_orbax_plugin as fop

SCRIPT = """
import sys
import numpy as np
import flax_orbax_plugin as fop

where, how, ending = sys.argv[1], sys.argv[2], sys.argv[3]
tree = {"w": np.arange(16 << 20, dtype=np.float32).reshape(64, -1)}  # 64 MB
if how == "core":
    fop.save_async(where, tree)
else:
    fop.CheckpointManager(where).save(7, {"params": tree})
if ending == "raise":
    raise RuntimeError("the training loop failed right after a save")
"""


@pytest.mark.parametrize("ending", ["raise", "return"])
@pytest.mark.parametrize("how", ["core", "manager"])
def test_a_save_in_flight_when_the_program_ends_commits(tmp_path, how, ending):
    where = tmp_path / "ckpt"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(where), how, ending],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr
    expected = np.arange(16 << 20, dtype=np.float32).reshape(64, -1)
    if how == "core":
        restored = fop.restore(where)["w"]
    else:
        assert fop.CheckpointManager(where, read_only=True).steps() == [7]
        restored = fop.CheckpointManager(where, read_only=True).restore(items="params")["w"]
    np.testing.assert_array_equal(restored, expected)
    assert fop.verify(where, all_steps=True)[0].ok


FAILING = """
import atexit, sys
import numpy as np
import flax_orbax_plugin as fop

atexit.register(lambda: print("the program's own exit handler ran", flush=True))
fop.CheckpointManager(sys.argv[1]).save(7, {"params": {"w": np.ones((256, 256))}})
"""


def test_a_save_that_fails_at_exit_makes_the_exit_status_1(tmp_path):
    """The background write fails (an injected EIO past the staging claim) while the
    program ends: said on stderr and in the exit status, never a silent 0; the
    program's own atexit handlers still run."""
    env = dict(os.environ, FOP_FAIL_AT="write_small:2")
    done = subprocess.run(
        [sys.executable, "-c", FAILING, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "that save failed" in done.stderr and "injected fault" in done.stderr
    assert "the program's own exit handler ran" in done.stdout
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == []
