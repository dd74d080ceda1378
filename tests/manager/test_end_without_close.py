"""A manager the program never closes (no ``with`` block, no ``close()``) ends with the
program: with one process, a program that ended well closes it, as the ``with`` block
would. Before, its persistent tier's copies in flight were cut off (the last steps were
never copied: lost with the local disk), and its lease on an object store stayed live
for its whole length (another host's next run waited it out). A real second process
each time: the interpreter's own exit is what is tested."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import flax_orbax_plugin as fop

pytest_plugins = ["_servers"]

TIERED = """
import sys
import numpy as np
import flax_orbax_plugin as fop

m = fop.CheckpointManager(sys.argv[1], persistent=fop.Tier(sys.argv[2], every=1))
for step in range(1, 4):
    m.save(step, {"params": {"w": np.full(1 << 20, step, np.float32)}})
"""


def _run(program: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=240
    )


def test_the_last_step_reaches_the_persistent_tier_when_the_program_ends(tmp_path):
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    done = _run(TIERED, str(local), str(persistent))
    assert done.returncode == 0, done.stderr
    assert "copying steps" in done.stderr  # the program does not end at once: said
    reader = fop.CheckpointManager(persistent, read_only=True)
    assert reader.steps()[-1] == 3
    w = reader.restore(step=3, items="params")["w"]
    np.testing.assert_array_equal(w, np.full(1 << 20, 3, np.float32))


LEASED = """
import sys
import numpy as np
import flax_orbax_plugin as fop

m = fop.CheckpointManager(sys.argv[1])
m.save(1, {"params": {"w": np.ones(4, np.float32)}})
if sys.argv[2] == "raise":
    raise RuntimeError("the training loop failed")
"""


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_a_bucket_lease_is_released_when_the_program_ends(s3_location, ending):
    done = _run(LEASED, s3_location.url, ending)
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr
    record = json.loads(s3_location.read("_RUN.json"))
    assert record["lease_expires"] == 0, record  # released: the next run opens at once
    assert fop.CheckpointManager(s3_location.url, read_only=True).steps() == [1]
