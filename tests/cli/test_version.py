"""One version, written once (``flax_orbax_plugin/_version.py``) and read by the package
metadata (setup.cfg's ``attr:``), ``flax_orbax_plugin.__version__``, ``flax-orbax
--version`` (the installed entry point and ``python -m``) and the changelog's newest
entry. The package said 0.1.0 while its README spoke of later releases."""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import re
import subprocess
import sys

import _paths

import flax_orbax_plugin as fop
from flax_orbax_plugin import _version

ENV = dict(os.environ, PYTHONPATH=_paths.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _cli(*command: str) -> str:
    p = subprocess.run(
        [*command, "--version"], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_the_version_is_written_once_and_read_everywhere():
    version = _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version) and version != "0.1.0", version
    assert fop.__version__ == version
    assert importlib.metadata.version("flax_orbax_plugin") == version  # the installed metadata
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(_paths.REPO, "setup.cfg"))
    assert cfg["metadata"]["version"] == "attr: flax_orbax_plugin._version.__version__"
    entry_point = os.path.join(os.path.dirname(sys.executable), "flax-orbax")
    assert _cli(entry_point) == f"flax-orbax {version}"
    assert _cli(sys.executable, "-m", "flax_orbax_plugin") == f"flax-orbax {version}"


def test_the_changelog_opens_with_this_version():
    text = open(os.path.join(_paths.REPO, "CHANGELOG.md")).read()
    newest = re.search(r"^## (\S+)", text, re.M)
    assert newest is not None and newest[1] == fop.__version__, newest
