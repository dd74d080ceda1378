"""An import that fails part way says which steps it had committed (whole) before the
failure, in Python (a note on the error) and on the command line, with how to go on:
a re-run replaces them only with force (``--force``), or ``--step`` the rest."""

from __future__ import annotations

import shutil

import numpy as np
import orbax.checkpoint as ocp
from flax import serialization

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

_COMMITTED = r"committed step(s) [0, 7]"


def _orbax_run(path) -> None:
    mngr = ocp.CheckpointManager(path, item_names=("params",))
    for step in (0, 7, 12):
        tree = {"w": np.full(3, step, np.float32)}
        mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
    mngr.wait_until_finished()
    mngr.close()
    shutil.rmtree(path / "12" / "params")  # damaged: the import fails at step 12


def test_a_failed_orbax_import_names_the_steps_it_committed(tmp_path, capsys):
    _orbax_run(tmp_path / "run")
    try:
        fop.import_orbax(tmp_path / "run", tmp_path / "out")
    except fop.CheckpointError as e:
        notes = " ".join(getattr(e, "__notes__", ()))
    else:
        raise AssertionError("the import of a damaged step passed")
    assert _COMMITTED in notes and "force=True" in notes
    rc = cli.main(["import", str(tmp_path / "run"), str(tmp_path / "out2")])
    _, err = capsys.readouterr()
    assert rc == 2
    assert _COMMITTED in err and "--force" in err and "run/12" in err


def test_a_failed_msgpack_import_names_the_steps_it_committed(tmp_path, capsys):
    src = tmp_path / "ckpts"
    src.mkdir()
    for step in (100, 120, 130):
        state = {"params": {"w": np.full(3, step, np.float32)}, "step": step}
        data = serialization.msgpack_serialize(state)
        (src / f"checkpoint_{step}").write_bytes(data if step != 130 else data[: len(data) // 2])
    rc = cli.main(["import", str(src), str(tmp_path / "out")])
    _, err = capsys.readouterr()
    assert rc == 2
    assert "committed step(s) [100, 120]" in err and "--step" in err
    assert fop.CheckpointManager(tmp_path / "out", read_only=True).steps() == [100, 120]
    rc = cli.main(["import", str(src), str(tmp_path / "out"), "--step", "100"])
    _, err = capsys.readouterr()
    assert rc == 2 and "step 100 exists already; to replace it pass" in err
