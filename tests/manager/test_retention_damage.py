"""Retention over damaged and vanished steps: a damaged step is neither counted as kept
nor removed, so ``keep=N`` still keeps N good steps (the writer's retention and
``flax-orbax gc``, dry run or not, alike); a step someone else removed is dropped from
the manager's list, and the next saves go on."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli


def _run(path, steps):
    with fop.CheckpointManager(path, async_save=False) as m:
        for s in steps:
            m.save(s, {"params": {"w": np.full(3, s, np.float32)}}, extras={"loss": 10.0 - s})


def _damage(path, *steps):
    for s in steps:
        (path / str(s) / "_CHECKPOINT.json").write_bytes(b'{"broken')


def _resumed_step(path):
    with fop.CheckpointManager(path, read_only=True) as m:
        return int(m.restore()["params"]["w"][0])


def test_a_writer_keeps_n_good_steps_past_damaged_newest_ones(tmp_path, caplog):
    run = tmp_path / "run"
    _run(run, range(1, 7))
    _damage(run, 5, 6)
    with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
        with fop.CheckpointManager(run, keep=2, async_save=False) as m:
            m.save(7, {"params": {"w": np.full(3, 7, np.float32)}})
            m.wait()
    assert "step 5 of" in caplog.text and "damaged" in caplog.text
    left = sorted(int(p.name) for p in run.iterdir() if p.name.isdigit())
    assert left == [4, 5, 6, 7]  # 7 and 4 are the two good ones; 5 and 6 left where they are


@pytest.mark.parametrize("dry_run", [True, False])
def test_gc_keeps_good_steps_past_damaged_ones(tmp_path, capsys, dry_run):
    run = tmp_path / "run"
    _run(run, range(1, 7))
    _damage(run, 5, 6)
    argv = ["gc", str(run), "--keep", "2"] + (["--dry-run"] if dry_run else [])
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert " steps: 1, 2\n" in out and " steps: 3, 4, 5, 6\n" in out
    if not dry_run:
        assert sorted(int(p.name) for p in run.iterdir() if p.name.isdigit()) == [3, 4, 5, 6]
        assert _resumed_step(run) == 4  # 6 and 5 skipped, logged


def test_a_step_removed_by_hand_leaves_the_next_saves_alone(tmp_path):
    run = tmp_path / "run"
    with fop.CheckpointManager(run, keep=2, async_save=False) as m:
        for s in (1, 2):
            m.save(s, {"params": {"w": np.full(3, s, np.float32)}})
        shutil.rmtree(run / "1")
        for s in (3, 4, 5):
            m.save(s, {"params": {"w": np.full(3, s, np.float32)}})
            m.wait()
        assert m.steps() == [4, 5]
