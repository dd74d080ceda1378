"""Hostile path arguments (issue 32, the red-team pass over the one path checker): a
path that names no place of its own, text no store can hold, a '~' that is never
expanded, a URL part that would be dropped, a store key with '.', '..' or an empty
component, a bucket or driver tensorstore refuses, or no path at all is an
UnsupportedLocationError naming the argument and what was given, at every entry point
(fop.save/restore/metadata, restore_params, CheckpointManager, CheckpointCallback, the
importers and exporters, the CLI), before anything is created: an empty path saved
a checkpoint over the current directory itself."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from flax import serialization

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

HOSTILE = [
    # (path, what the message must say)
    ("", r"an empty path, which would name the current directory"),
    (b"", r"an empty path"),
    ("file://", r"expected file:///<absolute path>, found no path"),
    ({"driver": "file"}, r"names no 'path' \(it would be the current directory\)"),
    ("~", r"'~' is not expanded here .*os.path.expanduser"),
    ("~/ckpts/run", r"'~/ckpts/run': '~' is not expanded here"),
    ("~alice/run", r"a folder named '~alice'"),
    ("run\0x", r"holds a NUL character"),
    ("run\udcffx", r"not valid UTF-8 at position 3"),
    ("file:///tmp/run?x=1", r"'\?' or '#' part names no place"),
    ("s3://bucket/run#v2", r"'\?' or '#' part names no place"),
    ("s3://bucket/a/../b", r"holds a '\.\.' component"),
    ("gs://bucket/a/./b", r"holds a '\.' component"),
    ("memory://a//b", r"holds a '' component"),
    ("s3://bucket//run", r"the key '/run/' holds a '' component"),  # was read as 'run'
    ("gs://bucket//run/x", r"the key '/run/x/' holds a '' component"),
    ("s3://b/run", r"'s3://b/run': Invalid S3 bucket name"),
    ("s3://user@bucket/run", r"Invalid S3 bucket name: \"user@bucket\""),
    ("gs://Bucket/run", r"Invalid GCS bucket name"),
    ({"driver": "bogus", "path": "x"}, r"\"bogus\" is not a registered KvStore driver"),
    ({"driver": "file", "path": 3}, r"'path' must be a str, found int 3"),
    (3, r"expected a path \(str or os.PathLike\), a URL or a kvstore spec dict, found int"),
    (None, r"found NoneType None"),
    ("C:\\ckpts\\run", r"holds a backslash \(a Windows path\?\)"),
    ("file:///tmp/a\\b", r"holds a backslash"),
    ("run ", r"'run ': begins or ends with whitespace .*than 'run'"),  # a config's space
    ("run\n", r"begins or ends with whitespace \(a stray space or newline"),
    (" ", r"begins or ends with whitespace"),
    ("s3://bucket/run ", r"'s3://bucket/run ': begins or ends with whitespace"),
]
IDS = [
    "empty",
    "empty-bytes",
    "file-no-path",
    "file-spec-no-path",
    "tilde",
    "tilde-slash",
    "tilde-user",
    "nul",
    "surrogate",
    "file-query",
    "s3-fragment",
    "s3-dotdot",
    "gs-dot",
    "memory-empty-component",
    "s3-leading-empty-component",
    "gs-leading-empty-component",
    "s3-short-bucket",
    "s3-userinfo",
    "gs-uppercase-bucket",
    "bogus-driver",
    "spec-path-int",
    "int",
    "none",
    "windows",
    "file-backslash",
    "trailing-space",
    "trailing-newline",
    "only-space",
    "s3-trailing-space",
]

TREE = {"params": {"w": np.ones(2, np.float32)}}


def _callback(p):
    cb = fop.CheckpointCallback(p, resume=True)
    try:
        cb.on_train_start(TREE)
    finally:
        cb.close()


ENTRY_POINTS = {
    "save": lambda p: fop.save(p, TREE),
    "save_async": lambda p: fop.save_async(p, TREE).wait(),
    "restore": lambda p: fop.restore(p),
    "metadata": lambda p: fop.metadata(p),
    "restore_params": lambda p: fop.restore_params(p),
    "verify": lambda p: fop.verify(p),
    "manager": lambda p: fop.CheckpointManager(p, async_save=False).save(1, TREE),
    "callback": _callback,
    "import_orbax": lambda p: fop.import_orbax(p, "out"),
    "import_into": lambda p: fop.import_msgpack(SOURCES["msgpack"], p, step=1),
    "export_to": lambda p: fop.to_safetensors(SOURCES["run"], p),
}
SOURCES: dict[str, str] = {}  # real sources, so that only the hostile argument is wrong


@pytest.fixture(scope="module", autouse=True)
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    with fop.CheckpointManager(root / "run", async_save=False) as mngr:
        mngr.save(1, TREE)
    (root / "state.msgpack").write_bytes(serialization.to_bytes(TREE))
    SOURCES.update(run=str(root / "run"), msgpack=str(root / "state.msgpack"))
    return SOURCES


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("path,message", HOSTILE, ids=IDS)
def test_hostile_path_is_refused_before_anything_is_made(
    tmp_path, monkeypatch, entry, path, message
):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(fop.CheckpointError) as info:
        ENTRY_POINTS[entry](path)
    # the path checker's words, or the manager's option checker (it refuses a path the
    # path checker would, naming its option) where it looks first
    assert isinstance(info.value, fop.OptionError) or (
        isinstance(info.value, fop.UnsupportedLocationError) and re.search(message, str(info.value))
    ), info.value
    assert os.listdir(work) == [], "nothing may be created for a refused path"
    assert work.is_dir() and os.getcwd() == str(work)


CLI = [
    ("list", "{}"),
    ("inspect", "{}"),
    ("verify", "{}"),
    ("gc", "{}"),
    ("import", "{} out"),
    ("import", "MSGPACK {} --step 1"),
    ("export", "{} out.safetensors"),
    ("export", "RUN {}"),
]
TEXT = [
    (row, i)
    for row, i in zip(HOSTILE, IDS, strict=True)
    if isinstance(row[0], str) and "\0" not in row[0]
]


@pytest.mark.parametrize("command,args", CLI, ids=[f"{c}:{a}" for c, a in CLI])
@pytest.mark.parametrize("path,message", [r for r, _ in TEXT], ids=[i for _, i in TEXT])
def test_hostile_path_on_the_command_line(
    tmp_path, monkeypatch, capsys, command, args, path, message
):
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    named = {"{}": path, "RUN": SOURCES["run"], "MSGPACK": SOURCES["msgpack"]}
    argv = [command, *(named.get(a, a) for a in args.split())]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"flax-orbax {command}: error:" in err
    assert "Traceback" not in err and "ValueError:" not in err and "RuntimeError" not in err
    assert re.search(message, err), err
    assert os.listdir(work) == []


def test_root_is_named_as_root(tmp_path):
    """A message about file:/// named the place '' ("no committed steps at :")."""
    assert str(fop.Location.from_path("file:///")) == "/"
    assert str(fop.Location.from_path("/")) == "/"


def test_a_dot_still_names_the_current_directory(tmp_path, monkeypatch):
    """What stays allowed: '.', './~' (a folder named '~'), spaces, unicode, 'C:' as a
    folder name."""
    monkeypatch.chdir(tmp_path)
    for path in [".", "./~/x", "sp ace ü/run", "C:/x"]:
        assert str(fop.Location.from_path(path)) == os.path.abspath(path)


def test_a_file_where_a_parent_directory_must_be_is_named(tmp_path):
    """A path below a file: a ForeignEntryError naming the file, which is left alone
    (it was a NotADirectoryError naming the save's staging name, or '<run>/')."""
    blocker = tmp_path / "afile"
    blocker.write_text("mine")
    tree = {"w": np.ones(3, np.float32)}
    said = f"{blocker} is a regular file, not a directory; it is left alone"
    for make in (
        lambda: fop.save(blocker / "sub", tree),
        lambda: fop.save(blocker / "sub" / "deeper", tree),
        lambda: fop.CheckpointManager(blocker / "run"),
    ):
        with pytest.raises(fop.ForeignEntryError, match=re.escape(said)):
            make()
    assert blocker.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["afile"]


def test_a_core_save_into_a_directory_of_steps_names_it(tmp_path):
    """It said only that something this library did not create was there."""
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    with pytest.raises(fop.ForeignEntryError, match="a CheckpointManager's directory of steps"):
        fop.save(run, {"w": np.ones(3, np.float32)})
    assert fop.CheckpointManager(run, read_only=True).steps() == [1]


def test_a_folder_whose_name_ends_in_a_space_that_exists_is_read(tmp_path):
    """The whitespace refusal is for a place that would be made: one that exists (made
    by another tool) is read as named."""
    made = tmp_path / "run "
    made.mkdir()
    fop.save(made / "ckpt", TREE)
    np.testing.assert_array_equal(
        fop.restore(str(made) + "/ckpt")["params"]["w"], TREE["params"]["w"]
    )
    with pytest.raises(fop.UnsupportedLocationError, match="whitespace"):
        fop.save(str(tmp_path / "new") + " ", TREE)
    assert sorted(os.listdir(tmp_path)) == ["run "]
