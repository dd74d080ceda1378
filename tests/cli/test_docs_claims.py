"""What README.md and the docs say of the command line and the environment, held to
what the code does: the paths ``flax-orbax list`` prints, the functions that take
``step=``, and the range of ``FOP_BACKGROUND_NICE``."""

from __future__ import annotations

import inspect
import json
import pathlib
import re

import numpy as np

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._base import env as _env

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
CLI = (ROOT / "docs" / "cli.md").read_text()
ORBAX = (ROOT / "docs" / "orbax.md").read_text()


def test_the_readme_list_example_shows_the_absolute_path_list_prints(tmp_path, monkeypatch, capsys):
    """The README showed 'ckpts: 3 step(s)' and '"directory": "ckpts"'; the command
    prints the directory's absolute path."""
    monkeypatch.chdir(tmp_path)
    with fop.CheckpointManager("ckpts", async_save=False) as mngr:
        mngr.save(100, {"params": {"w": np.ones(3, np.float32)}})
    assert cli.main(["list", "ckpts/"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"{tmp_path / 'ckpts'}: 1 step(s)", first
    assert cli.main(["list", "ckpts/", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["directory"] == str(tmp_path / "ckpts")
    for doc in (README, CLI):
        command = re.search(r"^\$ \S*flax-orbax list ckpts/", doc, re.M)
        assert command is not None, "the list example is gone"
        example = doc[command.start() :].splitlines()
        assert re.fullmatch(r"/\S+/ckpts: 3 step\(s\)", example[1]), example[1]
    example = CLI[CLI.index("$ flax-orbax list ckpts/ --json") :].splitlines()
    shown = next(line for line in example if line.startswith('{"directory"'))
    assert re.match(r'\{"directory": "/\S+/ckpts"', shown), shown


def test_the_readme_offers_step_only_where_the_function_takes_it():
    """The Orbax guide offered `step=` beside fop.restore, which takes none."""
    assert "step" not in inspect.signature(fop.restore).parameters
    claim = re.search(r"((?:`fop\.\w+`(?: and |, )?)+) also take `step=`", ORBAX)
    assert claim is not None, "docs/orbax.md names the functions that take step="
    for name in re.findall(r"`fop\.(\w+)`", claim.group(1)):
        assert "step" in inspect.signature(getattr(fop, name)).parameters, name
    assert "its latest step, or\n`step=`" not in ORBAX


def test_the_documented_nice_range_is_the_one_read_takes(monkeypatch):
    """The docs said <1-19> while 0 (the default: off) is taken."""
    option, default = _env.VARIABLES["FOP_BACKGROUND_NICE"]
    want = f"FOP_BACKGROUND_NICE=<{option.low:g}-{option.high:g}>"
    docs = [README] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    said = [m for doc in docs for m in re.findall(r"FOP_BACKGROUND_NICE=<[0-9]+-[0-9]+>", doc)]
    assert said and set(said) == {want}, said
    monkeypatch.setenv("FOP_BACKGROUND_NICE", "0")
    assert _env.read("FOP_BACKGROUND_NICE") == 0 == default  # 0 is off, the default
