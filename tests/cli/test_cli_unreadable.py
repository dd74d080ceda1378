"""A step whose files this process may not read: `list` lists every other step and says
which one it cannot read (it printed the header, then failed with exit 2)."""

from __future__ import annotations

import json
import os
import subprocess

import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop


def _as_a_user(*args) -> subprocess.CompletedProcess:
    """The command, with the permissions of files holding."""
    return _proc.run_as_a_user("-m", "flax_orbax_plugin", *args, timeout=120)


def test_list_names_the_step_it_cannot_read_and_lists_the_others(tmp_path):
    if not _proc.permissions_can_hold():
        pytest.skip("running as root without setpriv: nothing can be made unreadable")
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"params": {"w": np.ones(3)}})
    manifest = tmp_path / "run" / "2" / "_CHECKPOINT.json"
    manifest.chmod(0)
    try:
        table = _as_a_user("list", tmp_path / "run")
        doc = _as_a_user("list", tmp_path / "run", "--json")
    finally:
        manifest.chmod(0o644)
    assert table.returncode == 0, table.stderr
    rows = {line.split("|")[1].strip(): line for line in table.stdout.splitlines()[3:]}
    assert set(rows) == {"1", "2", "3"}, table.stdout
    assert "cannot be read" in rows["2"] and "Permission denied" in rows["2"]
    assert "DAMAGED" not in rows["2"] and "params" in rows["3"]
    steps = {s["step"]: s for s in json.loads(doc.stdout)["steps"]}
    assert steps[2]["damaged"].startswith("cannot be read") and steps[3]["damaged"] is None


def test_verify_all_checks_the_other_steps_past_one_it_cannot_read(tmp_path):
    """verify --all stopped at the first step it could not read: one error line, exit 2,
    no word of the other steps (nor a JSON document)."""
    if not _proc.permissions_can_hold():
        pytest.skip("running as root without setpriv: nothing can be made unreadable")
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"params": {"w": np.ones(3)}})
    data = tmp_path / "run" / "2" / "params" / "data"
    shut = next(p for p in data.iterdir() if p.suffix == ".bin")
    shut.chmod(0)
    try:
        text = _as_a_user("verify", tmp_path / "run", "--all")
        doc = _as_a_user("verify", tmp_path / "run", "--all", "--json")
    finally:
        shut.chmod(0o644)
    assert text.returncode == 2, (text.stdout, text.stderr)
    assert "UNREADABLE step 2: cannot be read" in text.stdout and "Permission denied" in text.stdout
    assert "ok       step 1/params" in text.stdout and "ok       step 3/params" in text.stdout
    assert "1 step(s) could not be read: 2" in text.stderr
    assert doc.returncode == 2, doc.stderr
    found = json.loads(doc.stdout)
    assert found["unreadable"] == 1 and found["damaged"] == 0 and not found["ok"]
    assert [r["step"] for r in found["results"] if r["ok"]] == [1, 3]


def test_a_step_folder_that_cannot_be_read_is_reported_per_step_by_every_reading_command(
    tmp_path,
):
    """A step folder shut to this process (chmod 000): list, inspect and verify exited 2
    with one raw line and no JSON. Each reports that step and goes on: list has its row,
    inspect reads the newest step it can (warning that it skipped the shut one), verify
    reports it UNREADABLE (exit 2) and checks the others."""
    if not _proc.permissions_can_hold():
        pytest.skip("running as root without setpriv: nothing can be made unreadable")
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"params": {"w": np.full(3, step, np.float32)}})
    (run / "3").chmod(0)
    try:
        got = {
            " ".join(args): _as_a_user(*args, run)
            for args in (
                ("list",),
                ("list", "--json"),
                ("inspect", "--json"),
                ("verify",),
                ("verify", "--all", "--json"),
            )
        }
    finally:
        (run / "3").chmod(0o755)
    table = got["list"]
    assert table.returncode == 0, table.stderr
    rows = {line.split("|")[1].strip(): line for line in table.stdout.splitlines()[3:]}
    assert set(rows) == {"1", "2", "3"} and "cannot be read" in rows["3"], table.stdout
    listed = got["list --json"]
    assert listed.returncode == 0, listed.stderr
    steps = {s["step"]: s for s in json.loads(listed.stdout)["steps"]}
    assert steps[3]["damaged"].startswith("cannot be read") and steps[2]["damaged"] is None
    inspected = got["inspect --json"]
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["path"] == str(run / "2")
    assert f"step 3 of {run} cannot be read" in inspected.stderr
    verified = got["verify"]
    assert verified.returncode == 2, verified.stdout + verified.stderr
    assert "UNREADABLE step 3: cannot be read" in verified.stdout
    every = got["verify --all --json"]
    assert every.returncode == 2, every.stderr
    found = json.loads(every.stdout)
    assert found["unreadable"] == 1 and found["damaged"] == 0
    assert [r["step"] for r in found["results"] if r["ok"]] == [1, 2]
    assert sorted(os.listdir(run)) == [".writer.lock", "1", "2", "3"]  # nothing set aside
