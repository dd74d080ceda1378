"""One step this process may not read (a permission; real ones: root drops the capability
that ignores them) blocked every entry point that chooses the latest step with a raw
PermissionError although older steps read. Now that step is skipped for the latest,
with a warning naming it, and never set aside as damaged (it stays where it is)."""

from __future__ import annotations

import json
import os

import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop

ENTRY_POINTS = r"""
import json, sys, warnings
import numpy as np
import flax_orbax_plugin as fop

run, out = sys.argv[1], {}
like = {"params": {"w": np.zeros(3, np.float32)}}
calls = {
    "restore_params": lambda: fop.restore_params(run)["w"],
    "manager_restore": lambda: fop.CheckpointManager(run).restore()["params"]["w"],
    "reader_restore": lambda: fop.CheckpointManager(run, read_only=True).restore()["params"]["w"],
    "latest_step": lambda: fop.CheckpointManager(run, read_only=True).latest_step(),
    "callback_resume": lambda: (
        fop.CheckpointCallback(run, resume=True).on_train_start(like)["params"]["w"]
    ),
}
for name, call in calls.items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            got = call()
            out[name] = {"value": np.asarray(got).tolist()}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    out[name]["warnings"] = [str(w.message) for w in seen]
try:
    fop.restore(run)
except fop.CheckpointError as e:
    out["restore_of_the_run"] = str(e)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.parametrize("shut", ["3", "3/_CHECKPOINT.json", "3/params"])
def test_a_step_that_cannot_be_read_is_skipped_for_the_latest_and_kept(tmp_path, shut):
    if not _proc.permissions_can_hold():
        pytest.skip("running as root without setpriv: nothing can be made unreadable")
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"params": {"w": np.full(3, step, np.float32)}})
    (run / shut).chmod(0)
    try:
        proc = _proc.run_as_a_user("-c", ENTRY_POINTS, str(run))
    finally:
        (run / shut).chmod(0o755)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    out = json.loads(lines[-1][len("RESULT ") :])
    for name in ("restore_params", "manager_restore", "reader_restore", "callback_resume"):
        assert out[name].get("value") == [2.0, 2.0, 2.0], (name, out[name])
        named = [w for w in out[name]["warnings"] if f"step 3 of {run} cannot be read" in w]
        assert named and "Permission denied" in named[0], (name, out[name]["warnings"])
    if shut == "3":  # the listing itself cannot tell it committed: not the latest
        assert out["latest_step"]["value"] == 2, out["latest_step"]
        assert "step folder(s) 3 cannot be read" in out["restore_of_the_run"]
    assert {"1", "2", "3"} <= set(os.listdir(run))
    assert not [n for n in os.listdir(run) if ".corrupt-" in n]  # never set aside
    with fop.CheckpointManager(run, read_only=True) as reader:  # readable again: the latest
        assert reader.steps() == [1, 2, 3]
        np.testing.assert_array_equal(reader.restore()["params"]["w"], np.full(3, 3))
