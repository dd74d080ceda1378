"""A removal that fails midway, and what it leaves: never silent, never blocking a run.

A step that retention renamed to ``<step>.deleting-<nonce>`` but whose files could not
be removed (a folder made read-only) is no longer a step: retention reports it
(``StepsRemoved``, then ``wait`` raises naming the place and the OS error; it said
"already gone" at INFO and nothing else). Its remains never block a later writer: the
open and ``delete`` pass over them with a WARNING naming them, ``gc`` raises naming
them once it did everything else (a raw ``PermissionError: '_METADATA.json'`` stopped
every open). The slot of a new step is checked before anything is written: a file
there (the save wrote everything, then failed at its commit) and an empty folder (the
listing calls it foreign, the save replaced it) are refused, naming it.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import flax_orbax_plugin as fop

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny(step: int) -> dict:
    return {"params": {"w": np.full((4,), step, np.float32)}}


def test_a_removal_failing_after_the_rename_is_reported_not_already_gone(
    tmp_path, monkeypatch, caplog
):
    events = []
    mngr = fop.CheckpointManager(tmp_path, keep=1, on_event=events.append)
    mngr.save(1, tiny(1))
    mngr.wait()
    monkeypatch.setenv("FOP_FAIL_AT", "remove_remains")
    mngr.save(2, tiny(2))
    with pytest.raises(fop.CheckpointError) as info:
        mngr.wait()
    left = [n for n in os.listdir(tmp_path) if n.startswith("1.deleting-")]
    assert len(left) == 1, os.listdir(tmp_path)
    text = str(info.value)
    assert "step 1: left the listing" in text and "InjectedFault" in text, text
    assert str(tmp_path / left[0]) in text, text
    assert "already gone" not in caplog.text
    assert [e.removed for e in events if isinstance(e, fop.StepsRemoved)] == [(1,)]
    assert mngr.steps() == [2]
    mngr.close()
    monkeypatch.delenv("FOP_FAIL_AT")
    with fop.CheckpointManager(tmp_path, keep=1) as again:  # the next writer removes them
        assert again.steps() == [2]
    assert sorted(os.listdir(tmp_path)) == [".writer.lock", "2"]


READ_ONLY_RUN = r"""
import json, logging, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np
import flax_orbax_plugin as fop

logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")
d = sys.argv[1]
tiny = lambda s: {"params": {"w": np.full((4,), s, np.float32)}}
out = {}
events = []
m = fop.CheckpointManager(d, keep=1, on_event=events.append)
m.save(1, tiny(1)); m.wait()
os.chmod(os.path.join(d, "1", "params"), 0o555)
m.save(2, tiny(2))
try:
    m.wait(); out["wait"] = "ok"
except fop.CheckpointError as e:
    out["wait"] = str(e)
m.close()
out["removed"] = [list(e.removed) for e in events if type(e).__name__ == "StepsRemoved"]
try:
    with fop.CheckpointManager(d) as m2:
        out["reopened"] = m2.steps()
        m2.save(3, tiny(3))
        m2.delete(2)
        out["after_delete"] = m2.steps()
except Exception as e:
    out["reopened"] = f"{type(e).__name__}: {e}"
try:
    with fop.CheckpointManager(d, keep=1) as m3:
        m3.gc(); out["gc"] = "ok"
except Exception as e:
    out["gc"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out))
"""


def test_a_read_only_folder_in_a_doomed_step_is_loud_and_never_blocks_the_run(tmp_path):
    """The probe's case, with real permissions (root drops the capability that ignores
    them): wait raises naming the remains and the file it could not remove; the next
    open and delete work; gc raises naming them; once writable, gc removes them."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: nothing can be made read-only")
    command = [sys.executable, "-c", READ_ONLY_RUN, str(tmp_path)]
    if os.geteuid() == 0:
        drop = "-dac_override,-dac_read_search,-fowner"
        command = ["setpriv", "--inh-caps", drop, "--bounding-set", drop, *command]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    for root, dirs, _ in os.walk(tmp_path):  # writable again, for what follows
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    out = json.loads(lines[-1][len("RESULT ") :])
    left = [n for n in os.listdir(tmp_path) if n.startswith("1.deleting-")]
    assert len(left) == 1, os.listdir(tmp_path)
    stuck = str(tmp_path / left[0] / "params" / "_METADATA.json")
    assert "step 1: left the listing" in out["wait"] and stuck in out["wait"], out
    assert out["removed"] == [[1]], out
    assert out["reopened"] == [2] and out["after_delete"] == [3], out
    assert left[0] in out["gc"] and stuck in out["gc"], out
    assert f"cannot remove unfinished step {tmp_path / left[0]}" in proc.stderr, proc.stderr
    assert "step 1 of" not in proc.stderr  # "retention: step 1 of ... is already gone"
    with fop.CheckpointManager(tmp_path) as mngr:
        assert mngr.gc() == [] and mngr.steps() == [3]
    assert sorted(os.listdir(tmp_path)) == [".writer.lock", "3"]


def test_a_file_at_the_step_name_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "7").write_bytes(b"a user's file")
    with fop.CheckpointManager(tmp_path) as mngr:
        with pytest.raises(fop.ForeignEntryError, match=r"cannot write step 7 at .*/7: .*file"):
            mngr.save(7, tiny(7))
        assert not [n for n in os.listdir(tmp_path) if n.startswith("7.")]
        mngr.save(8, tiny(8))
        mngr.wait()
        assert mngr.steps() == [8]
    assert (tmp_path / "7").read_bytes() == b"a user's file"


def test_an_empty_folder_at_the_step_name_is_foreign_and_never_replaced(tmp_path, caplog):
    """The open calls an empty ``8/`` foreign ("left alone"), and so does the save."""
    (tmp_path / "8").mkdir()
    with fop.CheckpointManager(tmp_path) as mngr:
        assert "left alone: 8" in caplog.text
        with pytest.raises(fop.ForeignEntryError, match=r"cannot write step 8 at .*empty folder"):
            mngr.save(8, tiny(8))
        mngr.save(9, tiny(9))
        mngr.wait()
        assert mngr.steps() == [9]
    assert (tmp_path / "8").is_dir() and not os.listdir(tmp_path / "8")
