"""What PATH names decides what --step and --item may add: a value that PATH already
decides otherwise is a usage error (exit 2), never ignored; --item of a step that lacks
it never falls back to another item; conflicting options are usage errors, not damage;
gc of a checkpoint that is no run directory is refused; export --dtype casts floats to
floats only, and a value it would overflow is an error unless --cast unsafe."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

VALUES = np.array([0.7, 1.6, -2.5, 300.0, 1e5], np.float32)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("paths")
    with fop.CheckpointManager(root / "run", async_save=False, keep=None) as m:
        for step in (5, 6):
            m.save(step, {"params": {"w": VALUES + step}})
    fop.save(root / "core", {"w": VALUES})
    return root


def run_cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out + err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["export", "{run}/5/params", "{out}", "--step", "6"], "--step 6: "),
        (["export", "{run}/5/params", "{out}", "--item", "nosuch"], "--item nosuch: "),
        (["export", "{run}", "{out}", "--item", "opt_state"], "has no item 'opt_state'"),
        (["export", "{core}", "{out}", "--item", "params"], "is a core checkpoint"),
        (["inspect", "{core}", "--step", "3"], "is a core checkpoint"),
        (["inspect", "{run}/5", "--step", "6"], "is one step"),
        (["verify", "{run}/5", "--step", "6"], "is one step"),
        (["verify", "{run}", "--step", "5", "--all"], "choose one"),
        (["gc", "{core}", "--keep", "1"], "is a core checkpoint, not a run directory"),
        (["gc", "{run}/5", "--keep", "1"], "is one step, not a run directory"),
        (["export", "{core}", "{out}", "--dtype", "int8"], "expected a floating dtype"),
        (["export", "{core}", "{out}", "--dtype", "float16"], "overflows"),
        (["gc", "{file}", "--keep", "1"], "a file, not a run directory"),
        (["gc", "{run}", "--keep-every", "5"], "--keep-every 5 does nothing without --keep"),
        (["export", "{core}", "{file}"], "expected a directory for the export"),
        (["export", "{core}", "{file}/x.safetensors"], "found a file at"),
    ],
)
def test_a_choice_path_decides_or_a_bad_cast_is_a_usage_error(
    capsys, places, tmp_path, argv, words
):
    (tmp_path / "afile").write_text("mine")
    fill = {"run": places / "run", "core": places / "core", "out": tmp_path / "o.safetensors"}
    fill["file"] = tmp_path / "afile"
    rc, said = run_cli(capsys, *[a.format(**fill) for a in argv])
    assert rc == 2 and words in said, said
    assert not (tmp_path / "o.safetensors").exists()  # nothing written
    assert fop.CheckpointManager(places / "run", read_only=True).steps() == [5, 6]


def test_what_path_names_itself_is_still_accepted(capsys, places, tmp_path):
    """The item PATH names (no --item, or --item naming it), its own step, and a run's
    default item: each exports what was asked, bit for bit."""
    for n, argv in enumerate(
        [
            [places / "run/5/params", "--item", "params", "--step", "5"],
            [places / "run", "--step", "5"],
        ]
    ):
        out = tmp_path / f"{n}.safetensors"
        rc, said = run_cli(capsys, "export", argv[0], out, *argv[1:])
        assert rc == 0, said
        np.testing.assert_array_equal(safetensors.numpy.load_file(out)["w"], VALUES + 5)
    out = tmp_path / "cast.safetensors"
    rc, said = run_cli(
        capsys, "export", places / "core", out, "--dtype", "float16", "--cast", "unsafe"
    )
    assert rc == 0, said
    assert np.isinf(safetensors.numpy.load_file(out)["w"][-1])


def test_a_memory_url_out_from_a_shell_is_refused(places, tmp_path):
    """From a shell what a command writes to memory:// is lost when it exits: refused."""
    argv = [
        sys.executable,
        "-c",
        "from flax_orbax_plugin.cli import main; raise SystemExit(main())",
    ]
    done = subprocess.run(
        [*argv, "import", str(places / "core"), "memory://lost/run"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "lost when it exits" in done.stderr, done.stderr


def test_gc_under_a_live_writer_says_what_to_do_in_the_command_lines_words(capsys, tmp_path):
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as m:
        m.save(1, {"params": {"w": VALUES}})
        rc, said = run_cli(capsys, "gc", tmp_path / "run", "--keep", "1")
    assert rc == 2 and "live writer" in said and "--dry-run" in said, said
    assert "read_only" not in said


def test_a_run_whose_steps_were_all_set_aside_is_damage_not_an_empty_run(capsys, tmp_path):
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as m:
        for step in (1, 2):
            m.save(step, {"params": {"w": VALUES}})
    for step in (1, 2):
        (tmp_path / "run" / str(step)).rename(tmp_path / "run" / f"{step}.corrupt-ab{step}")
    rc, said = run_cli(capsys, "verify", tmp_path / "run")
    assert rc == 1 and "every step was set aside as damaged" in said, said
    with pytest.raises(fop.CorruptCheckpointError, match="1.corrupt-ab1, 2.corrupt-ab2"):
        fop.restore_params(tmp_path / "run")


def test_verify_json_names_the_path_as_list_does(capsys, places, monkeypatch):
    import json

    monkeypatch.chdir(places)
    said = {}
    for command in ("list", "verify"):
        rc, out = run_cli(capsys, command, "run", "--json")
        said[command] = json.loads(out)
    assert said["verify"]["path"] == said["list"]["directory"] == str((places / "run").resolve())
