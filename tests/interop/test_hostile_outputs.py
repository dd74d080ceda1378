"""Hostile output places for the exporters and importers (issue 32, the red-team
pass): an export or an import whose output lies inside a committed checkpoint (a step,
one of its items, a core checkpoint) or inside a run directory is refused with an
UnsupportedLocationError naming what holds it, through fop.to_safetensors /
fop.import_msgpack and the CLI, and the checkpoint is left as it was. ``flax-orbax
export RUN RUN/1/params`` wrote model.safetensors into the committed params item (and
``verify`` still called it ok); ``export RUN RUN/2`` made a folder named like a step."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from flax import serialization

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

TREE = {"params": {"w": np.arange(4, dtype=np.float32)}}


@pytest.fixture
def world(tmp_path):
    run, core = tmp_path / "run", tmp_path / "core"
    with fop.CheckpointManager(run, async_save=False) as mngr:
        mngr.save(1, TREE, extras={"loss": 0.5})
    fop.save(core, TREE["params"])
    (tmp_path / "state.msgpack").write_bytes(serialization.to_bytes(TREE))
    os.symlink(run / "1" / "params", tmp_path / "link")
    return tmp_path


def snapshot(root):
    return sorted(
        (os.path.relpath(os.path.join(d, f), root), os.path.getsize(os.path.join(d, f)))
        for d, _, files in os.walk(root)
        for f in files
    )


EXPORT_OUTS = [
    ("run/1/params", r"inside step 1 of the run directory"),
    ("run/1/params/model.safetensors", r"inside step 1 of the run directory"),
    ("run/1/extras/sub/dir", r"inside step 1"),
    ("run/1", r"inside step 1"),
    ("run", r"inside the run directory .*run \(it holds committed steps\)"),
    ("run/2", r"inside the run directory"),
    ("link", r"inside step 1"),  # a link into a committed item
    ("core", r"inside the checkpoint .*core \(written by fop.save\)"),
    ("core/sub", r"inside the checkpoint"),
]
IMPORT_OUTS = [
    ("run/1", r"inside the run directory"),
    ("run/1/params/new", r"inside step 1"),
    ("run/7", r"inside the run directory"),
    ("core/sub", r"inside the checkpoint .*core"),
    ("link/new", r"inside step 1"),
]


@pytest.mark.parametrize("out,message", EXPORT_OUTS, ids=[o for o, _ in EXPORT_OUTS])
def test_export_into_a_checkpoint_is_refused(world, capsys, out, message):
    before = snapshot(world)
    with pytest.raises(fop.UnsupportedLocationError, match=message):
        fop.to_safetensors(world / "run" / "1" / "params", world / out)
    assert cli.main(["export", str(world / "run"), str(world / out)]) == 2
    assert "safetensors output" in capsys.readouterr().err
    assert snapshot(world) == before
    assert all(r.ok for r in fop.verify(world / "run"))


@pytest.mark.parametrize("out,message", IMPORT_OUTS, ids=[o for o, _ in IMPORT_OUTS])
def test_import_into_a_checkpoint_is_refused(world, capsys, out, message):
    before = snapshot(world)
    with pytest.raises(fop.UnsupportedLocationError, match=message):
        fop.import_msgpack(world / "state.msgpack", world / out, step=1)
    argv = ["import", str(world / "state.msgpack"), str(world / out), "--step", "1"]
    assert cli.main(argv) == 2
    assert "import output" in capsys.readouterr().err
    assert snapshot(world) == before


def test_exports_and_imports_beside_the_checkpoint_still_work(world):
    fop.to_safetensors(world / "run" / "1" / "params", world / "export")
    assert os.path.exists(world / "export" / "model.safetensors")
    assert fop.import_msgpack(world / "state.msgpack", world / "imported", step=3) == [3]
    assert fop.import_msgpack(world / "state.msgpack", world / "imported", step=4) == [4]


SOURCES_OF_OURS = [
    ("run", r"the run directory .*run \(it holds committed steps\)"),
    ("run/1", r"step 1 of the run directory"),
    ("run/1/params", r"step 1 of the run directory"),
    ("core", r"the checkpoint .*core"),
]


@pytest.mark.parametrize("src,message", SOURCES_OF_OURS, ids=[s for s, _ in SOURCES_OF_OURS])
def test_importing_a_checkpoint_of_ours_says_so(world, capsys, src, message):
    """It said "no flax.training.checkpoints files (checkpoint_<step>) in it"."""
    before = snapshot(world)
    assert cli.main(["import", str(world / src), str(world / "out")]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"import source .*: is \(or lies inside\) {message}", err), err
    assert "a checkpoint of this library already: nothing to import" in err
    assert "flax.training.checkpoints" not in err
    assert snapshot(world) == before
