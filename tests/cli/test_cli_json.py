"""``--json`` on list, inspect, verify and gc: parsed, validated against the documented
schema (docs/cli.md holds exactly ``output.SCHEMAS``), and checked against what the
library reads; ``gc --dry-run`` removes nothing and names what ``gc`` then removes;
every printed time is ISO 8601 with its zone."""

import datetime
import json
import os
import re
import shutil

import _files
import _paths
import jsonschema
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._core import ownership as _ownership
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._format import steps as _steps
from flax_orbax_plugin._storage.location import Location
from flax_orbax_plugin.cli.output import SCHEMAS

STEPS = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("json") / "run"
    with fop.CheckpointManager(directory) as mngr:
        for step in STEPS:
            mngr.save(
                step,
                {"params": {"w": np.full((16, 8), step, np.float32), "b": np.zeros(3, np.int32)}},
                extras={"loss": 1.0 / step, "lr": float("nan"), "note": "x"},
            )
    return directory


def run_json(capsys, command, *argv):
    rc = cli.main([command, *map(str, argv), "--json"])
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1, out  # one document, nothing else on stdout
    doc = json.loads(out)
    jsonschema.validate(doc, SCHEMAS[command])
    return rc, doc, err


def test_docs_show_exactly_the_schemas():
    text = open(os.path.join(_paths.REPO, "docs", "cli.md")).read()
    for command, schema in SCHEMAS.items():
        block = text.split(f"## `flax-orbax {command} --json`", 1)[1].split("```json\n", 1)[1]
        assert json.loads(block.split("\n```", 1)[0]) == schema, command
        jsonschema.Draft202012Validator.check_schema(schema)


def _as_time(text):
    parsed = datetime.datetime.fromisoformat(text)
    assert parsed.utcoffset() is not None, text  # a zone, always
    return parsed.timestamp()


def test_list_json(run_dir, capsys):
    rc, doc, _ = run_json(capsys, "list", run_dir)
    assert rc == 0 and doc["directory"] == str(run_dir)
    assert [s["step"] for s in doc["steps"]] == list(STEPS)
    loc = Location.from_path(run_dir)
    for row in doc["steps"]:
        manifest = _layout.read_manifest(_steps.step_location(loc, row["step"]))
        assert abs(_as_time(row["saved_at"]) - manifest.time) < 1
        assert row["metrics"] == {"loss": 1.0 / row["step"]}  # NaN left out, text too
        assert row["items"] == ["extras", "params"] and row["damaged"] is None
        assert row["size_bytes"] == loc.child(str(row["step"])).size_bytes()
        assert row["bytes_written"] == manifest.bytes_written
    # one step: that step alone
    rc, doc, _ = run_json(capsys, "list", run_dir / "2")
    assert rc == 0 and [s["step"] for s in doc["steps"]] == [2]


def test_list_table_times_carry_their_zone(run_dir, capsys):
    assert cli.main(["list", str(run_dir)]) == 0
    out = capsys.readouterr().out
    times = re.findall(r"\| (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d) +\|", out)
    assert len(times) == len(STEPS), out
    manifest = _layout.read_manifest(_steps.step_location(Location.from_path(run_dir), 1))
    assert abs(_as_time(times[0]) - manifest.time) < 1


def test_inspect_json(run_dir, capsys):
    rc, doc, _ = run_json(capsys, "inspect", run_dir)
    assert rc == 0 and doc["path"] == str(run_dir / "4")
    items = {i["name"]: i for i in doc["items"]}
    assert items["extras"]["value"]["loss"] == 0.25
    leaves = {leaf["path"]: leaf for leaf in items["params"]["leaves"]}
    assert leaves["w"] == {
        "path": "w",
        "shape": [16, 8],
        "dtype": "float32",
        "sharding": None,
        "bytes": 512,
    }
    assert leaves["b"]["dtype"] == "int32" and leaves["b"]["bytes"] == 12
    assert items["params"]["total_bytes"] == doc["total_bytes"] == 524
    assert items["params"]["values"] == 131


def test_verify_json_ok_and_damaged(run_dir, capsys, tmp_path):
    rc, doc, _ = run_json(capsys, "verify", run_dir, "--all")
    assert rc == 0 and doc["ok"] is True and doc["damaged"] == 0
    assert sorted((r["step"], r["item"]) for r in doc["results"]) == sorted(
        (s, i) for s in STEPS for i in ("extras", "params")
    )
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir, damaged)
    data = [
        os.path.join(d, f)
        for d, _, fs in os.walk(damaged / "4" / "params")
        for f in fs
        if not f.endswith(".json") and not f.startswith("_")
    ]
    _files.flip_byte(max(data, key=os.path.getsize))
    rc, doc, _ = run_json(capsys, "verify", damaged)
    assert rc == cli.EXIT_DAMAGED and doc["ok"] is False and doc["damaged"] == 1
    bad = [r for r in doc["results"] if not r["ok"]]
    assert [(r["step"], r["item"]) for r in bad] == [(4, "params")] and "w" in bad[0]["error"]


def _dead_save(directory, name):
    """What a save killed mid-way leaves: our staging name with our pending marker."""
    os.makedirs(directory / name / "params")
    nonce = name.rsplit("-", 1)[1]
    (directory / name / _ownership.PENDING_FILE).write_bytes(_ownership._pending_bytes(nonce))


def _tree(directory):
    return sorted(
        os.path.relpath(os.path.join(d, f), directory)
        for d, dirs, fs in os.walk(directory)
        for f in fs + dirs
    )


def test_gc_dry_run_removes_nothing_and_names_what_gc_removes(run_dir, capsys, tmp_path):
    work = tmp_path / "gc"
    shutil.copytree(run_dir, work)
    _dead_save(work, "5.partial-abc123")
    os.makedirs(work / "6.partial-def456" / "mine")  # our name pattern, not our marker
    before = _tree(work)
    rc, plan, _ = run_json(capsys, "gc", work, "--keep", 2, "--keep-every", 3, "--dry-run")
    assert rc == 0 and plan["dry_run"] is True
    assert _tree(work) == before  # nothing removed, no lock file taken
    assert plan["removed_steps"] == [1, 2] and plan["kept_steps"] == [3, 4]
    assert plan["removed_unfinished"] == ["5.partial-abc123"]
    assert plan["left_alone"] == ["6.partial-def456"]
    assert cli.main(["gc", str(work), "--keep", "2", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "would remove steps: 1, 2" in text and "nothing was removed" in text
    assert _tree(work) == before
    # the real gc removes exactly what the dry run named
    rc, done, _ = run_json(capsys, "gc", work, "--keep", 2, "--keep-every", 3)
    assert rc == 0 and done["dry_run"] is False
    for key in ("removed_steps", "kept_steps", "removed_unfinished", "left_alone"):
        assert done[key] == plan[key], key
    assert sorted(n for n in os.listdir(work) if not n.startswith(".")) == [
        "3",
        "4",
        "6.partial-def456",
    ]


def test_list_json_of_what_is_no_directory_of_steps_says_what_to_use(run_dir, capsys, tmp_path):
    core = tmp_path / "core"
    fop.save(core, {"w": np.zeros(2, np.float32)})
    for path in (run_dir / "4" / "params", core):
        assert cli.main(["list", str(path), "--json"]) == cli.EXIT_ERROR
        out, err = capsys.readouterr()
        assert out == "" and "not a directory of steps" in err and "inspect" in err
    assert cli.main(["list", str(tmp_path / "missing"), "--json"]) == cli.EXIT_ERROR
    assert capsys.readouterr().out == ""
    (tmp_path / "empty").mkdir()
    rc, doc, _ = run_json(capsys, "list", tmp_path / "empty")
    assert rc == 0 and doc["steps"] == [] and doc["unfinished"] == []


def test_list_does_not_give_a_partial_size_as_the_steps_size(tmp_path):
    """A step folder part of which cannot be read (here an item made unreadable, the
    command run without root's override where the tests run as root) was listed with
    the bytes it could read, as if whole. Its size is now unknown (null, '?')."""
    import shutil as _shutil
    import subprocess
    import sys

    from _proc import child_env

    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, {"params": {"w": np.ones(1000, np.float32)}, "opt_state": {"m": np.ones(3)}})
    command = [sys.executable, "-m", "flax_orbax_plugin", "list", str(run), "--json"]
    if os.geteuid() == 0:
        if _shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: nothing can be made unreadable")
        drop = "-dac_override,-dac_read_search,-fowner"
        command = ["setpriv", "--inh-caps", drop, "--bounding-set", drop, *command]
    whole = json.loads(
        subprocess.run(command, capture_output=True, text=True, env=child_env(), check=True).stdout
    )
    assert whole["steps"][0]["size_bytes"] > 4000
    os.chmod(run / "1" / "params", 0)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=child_env())
    finally:
        os.chmod(run / "1" / "params", 0o755)
    assert json.loads(proc.stdout)["steps"][0]["size_bytes"] is None, proc.stdout + proc.stderr
