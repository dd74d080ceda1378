"""What a save or removal that died leaves is ours, and the next save or ``gc`` removes it.

- A removal killed while writing its pending marker leaves the marker's temporary file
  (``_PENDING.json.tmp-<hex>``, our marker inside): it proves the place ours (it was
  "nothing in it proves this library wrote it", forever).
- ``fop.save(force=True)`` killed between its renames leaves ``<name>.partial-<nonce>``
  or ``<name>.deleting-<nonce>``, a whole checkpoint with a valid commit marker and no
  pending marker (so no process to ask): once nothing changed there for
  ``writer_liveness.QUIET_SECONDS`` no live writer holds it, and the next save of that name or
  ``gc`` of its directory removes it (they were left for an hour, or for ever by gc).
- A save that fails before writing anything (a file size limit) removes its empty
  staging itself, and its error names the file it was writing.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import ownership as _ownership
from flax_orbax_plugin._core import writer_liveness as _liveness
from flax_orbax_plugin._storage.location import Location
from flax_orbax_plugin.cli.commands import gc_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TMP_MARKER = _ownership.PENDING_FILE + ".tmp-0123456789abcdef"


def tiny(step: int) -> dict:
    return {"params": {"w": np.full((4,), step, np.float32)}}


def _run(tmp_path):
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, tiny(1))
        mngr.save(2, tiny(2))
    return run


def test_a_cut_short_marker_write_in_a_step_being_removed_is_ours(tmp_path):
    """Killed writing the marker of a step renamed for removal: the next open removes
    it whole (the temporary file was kept as "not ours", then nothing proved it ours)."""
    run = _run(tmp_path)
    doomed = run / "1.deleting-0abc"
    os.rename(run / "1", doomed)
    (doomed / TMP_MARKER).write_bytes(_ownership._pending_bytes("0abc"))
    assert gc_plan(Location.from_path(str(run)), keep=None, keep_every=None).unfinished == [
        doomed.name
    ]
    with fop.CheckpointManager(run) as mngr:
        assert mngr.steps() == [2]
    assert sorted(os.listdir(run)) == [".writer.lock", "2"]


def test_a_folder_holding_only_the_temporary_marker_is_removed(tmp_path, caplog):
    run = _run(tmp_path)
    (run / "149.deleting-671633652cd8").mkdir()
    (run / "149.deleting-671633652cd8" / TMP_MARKER).write_bytes(_ownership._pending_bytes("x1"))
    (run / "150.deleting-abc").mkdir()  # a file of that name that is not our marker
    (run / "150.deleting-abc" / TMP_MARKER).write_bytes(b'{"library": "someone else"}')
    with fop.CheckpointManager(run) as mngr:
        assert mngr.steps() == [1, 2]
    assert sorted(os.listdir(run)) == [".writer.lock", "1", "150.deleting-abc", "2"]
    assert "150.deleting-abc left alone: nothing in it proves" in caplog.text


def _abandon(path, kind: str):
    """A copy of the checkpoint ``path`` at ``<path>.<kind>-<nonce>``: what a force save
    killed between its renames leaves (a commit marker, no pending marker)."""
    left = path.parent / f"{path.name}.{kind}-dead{kind[0]}1"
    shutil.copytree(path, left)
    return left


def test_the_next_save_of_a_path_removes_its_abandoned_copies(tmp_path, monkeypatch):
    path = tmp_path / "core"
    fop.save(path, tiny(1))
    partial, deleting = _abandon(path, "partial"), _abandon(path, "deleting")
    other = tmp_path / "core2.partial-x1"  # another name's: never this save's to remove
    shutil.copytree(path, other)
    fop.save(path, tiny(2), force=True)  # just now: a live writer may hold them
    assert partial.is_dir() and deleting.is_dir()
    monkeypatch.setattr(_liveness, "QUIET_SECONDS", 0.0)
    fop.save(path, tiny(3), force=True)
    assert sorted(os.listdir(tmp_path)) == ["core", other.name]
    np.testing.assert_array_equal(fop.restore(path)["params"]["w"], tiny(3)["params"]["w"])


def test_gc_removes_abandoned_copies_and_empty_staging_beside_a_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "core"
    fop.save(path, tiny(1))
    _abandon(path, "partial")
    _abandon(path, "deleting")
    (tmp_path / "core.partial-empty1").mkdir()  # a save that failed before its marker
    monkeypatch.setattr(_liveness, "QUIET_SECONDS", 0.0)
    plan = gc_plan(Location.from_path(str(tmp_path)), keep=None, keep_every=None)
    assert sorted(plan.unfinished) == [
        "core.deleting-deadd1",
        "core.partial-deadp1",
        "core.partial-empty1",
    ]
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.gc()
    assert sorted(os.listdir(tmp_path)) == [".writer.lock", "core"]


FILE_SIZE_LIMIT = r"""
import json, os, resource, signal, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np
import flax_orbax_plugin as fop

d = sys.argv[1]
tree = {"params": {"w": np.ones((64, 64), np.float32)}}
with fop.CheckpointManager(os.path.join(d, "run")) as m:
    m.save(1, tree)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
out = {}
for limit in (0, 100):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        fop.save(os.path.join(d, f"core{limit}"), tree)
        out[f"core{limit}"] = "saved"
    except Exception as e:
        out[f"core{limit}"] = f"{type(e).__name__}: {e}"
    try:
        with fop.CheckpointManager(os.path.join(d, "run")) as m:
            m.save(1 + limit, tree, extras={"loss": 1.0})
        out[f"step{limit}"] = "saved"
    except Exception as e:
        out[f"step{limit}"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""


def test_a_save_failing_at_its_first_byte_removes_its_empty_staging(tmp_path):
    """RLIMIT_FSIZE of 0 and 100 bytes: every save raises naming the file it was
    writing ("OSError: [Errno 27] File too large" named none), and no empty
    ``<name>.partial-<nonce>`` stays beside the checkpoint or among the steps."""
    command = [sys.executable, "-c", FILE_SIZE_LIMIT, str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    out = json.loads(lines[-1][len("RESULT ") :])
    for what, error in out.items():
        assert "File too large" in error and f"{tmp_path}/" in error, (what, error)
    assert sorted(os.listdir(tmp_path)) == ["run"], os.listdir(tmp_path)
    assert sorted(os.listdir(tmp_path / "run")) == [".writer.lock", "1"]
