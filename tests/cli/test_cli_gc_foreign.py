"""``flax-orbax gc`` on another library's run: Orbax steps or Flax msgpack
``checkpoint_<n>`` files, and none of this library's steps, is an error (exit 2) saying
gc removes only this library's steps; a folder of other things stays "nothing to do"."""

from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
from flax import serialization

from flax_orbax_plugin import cli


def _gc(capsys, *argv):
    rc = cli.main(["gc", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_gc_of_another_librarys_run_is_an_error(capsys, tmp_path):
    """It printed 'not steps of this library (left alone): 1, 2' and exited 0."""
    orbax_run = tmp_path / "orbax"
    with ocp.CheckpointManager(orbax_run) as mngr:
        for step in (1, 2):
            state = {"w": np.ones(3, np.float32)}
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        mngr.wait_until_finished()
    msgpack_run = tmp_path / "msgpack"
    msgpack_run.mkdir()
    (msgpack_run / "checkpoint_5").write_bytes(serialization.to_bytes({"w": np.ones(3)}))
    for run, what in ((orbax_run, "an Orbax run"), (msgpack_run, "Flax msgpack")):
        for extra in ((), ("--dry-run",), ("--keep", "1")):
            rc, out, err = _gc(capsys, run, *extra)
            assert rc == 2 and what in err and "only this library's steps" in err, (extra, err)
            assert "flax-orbax import" in err and out == "", err
    assert sorted(p.name for p in orbax_run.iterdir()) == ["1", "2"]
    assert [p.name for p in msgpack_run.iterdir()] == ["checkpoint_5"]


def test_gc_of_a_folder_of_other_things_has_nothing_to_do(capsys, tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"torch")
    (folder / "checkpoint_3").write_text("notes, no msgpack")
    rc, out, _ = _gc(capsys, folder)
    assert rc == 0 and "removed unfinished: none" in out
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_3", "model.pt"]


def test_a_dry_run_beside_a_live_writer_says_a_real_gc_would_refuse(capsys, tmp_path):
    """It listed the live save's staging as 'would remove unfinished', without a word."""
    import warnings

    import flax_orbax_plugin as fop

    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": {"w": np.ones(3)}})
        mngr.wait()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rc, out, _ = _gc(capsys, tmp_path / "run", "--dry-run")
        assert rc == 0 and "dry run: nothing was removed" in out
        said = [str(w.message) for w in seen]
        assert any("a real gc would refuse" in m and f"pid {os.getpid()}" in m for m in said)
    with warnings.catch_warnings(record=True) as seen:  # closed: nothing to say
        warnings.simplefilter("always")
        _gc(capsys, tmp_path / "run", "--dry-run")
    assert not any("a real gc would refuse" in str(w.message) for w in seen)


def test_gc_names_what_it_leaves_alone_once(capsys, caplog, tmp_path):
    """Beside its result line, gc's warning about entries that are not steps came twice
    (the manager's open, then gc itself); once now."""
    import flax_orbax_plugin as fop

    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        for step in (1, 2):
            mngr.save(step, {"params": {"w": np.ones(3, np.float32)}})
    (run / "notes.txt").write_text("mine")
    rc, out, _ = _gc(capsys, run, "--keep", "1")
    assert rc == 0 and "not steps of this library (left alone): notes.txt" in out, out
    said = [r for r in caplog.records if "not steps of this library, left alone" in r.message]
    assert len(said) == 1, [r.message for r in said]
    assert (run / "notes.txt").read_text() == "mine"
