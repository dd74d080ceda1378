"""`flax-orbax --help`, `<command> --help` and `--version` answer without importing JAX,
tensorstore or the storage layers; every argument is described and every command's
help has examples. Each case runs in a child process (the parent has JAX loaded).

How fast they answer is measured by benchmarks/bench_cli_startup.py, not here.
"""

import argparse
import ast
import importlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys

import _paths
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin.cli.main import build_parser

REPO = _paths.REPO
HEAVY = ("jax", "jaxlib", "tensorstore", "numpy", "rich", "matplotlib")  # progress, plots too
COMMANDS = ["export", "gc", "import", "inspect", "list", "verify"]  # every one, checked below

# Calls the console script's function, flax_orbax_plugin.cli:main, then reports.
RUNNER = (
    f"HEAVY = {HEAVY!r}\n"
    + """
import contextlib, io, json, sys
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        from flax_orbax_plugin.cli import main
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
print(json.dumps({"code": code, "stdout": out.getvalue(),
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}))
"""
)


def _env():
    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _entry_point(*argv):
    """(exit code, stdout, heavy modules loaded) of cli.main(argv) in a fresh process."""
    p = subprocess.run(
        [sys.executable, "-c", RUNNER, *argv],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout.splitlines()[-1])
    return report["code"], report["stdout"], report["loaded"]


def _python_m(*argv):
    """(exit code, stdout, modules imported) of `python -X importtime -m flax_orbax_plugin`."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "flax_orbax_plugin", *argv],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = set(re.findall(r"^import time:.*\|\s*(\S+)\s*$", p.stderr, flags=re.M))
    assert imported, p.stderr  # -X importtime reported nothing: the check would be empty
    return p.returncode, p.stdout, imported


ARGVS = [["--help"], ["--version"]] + [[c, "--help"] for c in COMMANDS]


@pytest.mark.parametrize("argv", ARGVS, ids=" ".join)
def test_help_and_version_through_the_entry_point_import_nothing_heavy(argv):
    code, stdout, loaded = _entry_point(*argv)
    assert code == 0, stdout
    assert loaded == [], f"{' '.join(argv)} imported {loaded}"
    if argv == ["--version"]:
        assert stdout.strip() == f"flax-orbax {importlib.metadata.version('flax_orbax_plugin')}"
    else:
        assert stdout.startswith("usage: flax-orbax"), stdout


@pytest.mark.parametrize("argv", ARGVS, ids=" ".join)
def test_help_and_version_through_python_m_import_nothing_heavy(argv):
    code, stdout, imported = _python_m(*argv)
    assert code == 0, stdout
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert heavy == [], f"python -m flax_orbax_plugin {' '.join(argv)} imported {heavy}"
    assert "flax_orbax_plugin._api" not in imported
    if argv == ["--version"]:
        assert re.fullmatch(r"flax-orbax \S+\n", stdout), stdout
    else:
        command = argv[0] if len(argv) == 2 else "COMMAND"
        assert "\nexamples:\n" in stdout, stdout
        examples = stdout.split("\nexamples:\n", 1)[1]
        lines = [ln.strip() for ln in examples.splitlines() if ln.strip()]
        if command != "COMMAND":
            assert stdout.startswith(f"usage: flax-orbax {command} "), stdout
            assert 1 <= len(lines) <= 2 and all(
                ln.startswith(f"flax-orbax {command} ") for ln in lines
            ), examples


def _actions(parser):
    for action in parser._actions:  # argparse keeps no public list of them
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {a}", h) for a, h in _actions(sub))
        else:
            yield "/".join(action.option_strings) or action.dest, action.help


def test_every_command_runs_and_every_argument_is_described():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    undescribed = [name for name, help in _actions(parser) if not (help or "").strip()]
    assert undescribed == []
    assert sorted(subs.choices) == COMMANDS  # a new command gets its help checked too
    # cli.dispatch runs exactly the commands parsed (imported here, it loads JAX: the
    # parent has it already)
    assert sorted(importlib.import_module("flax_orbax_plugin.cli.dispatch").COMMANDS) == COMMANDS


def test_import_flax_orbax_plugin_is_light_and_loads_the_api_on_first_use():
    code = (
        "import sys, flax_orbax_plugin as fop\n"
        f"before = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "fop.CheckpointManager\n"
        "print(before, 'jax' in sys.modules, fop.__version__)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["[]", "True", importlib.metadata.version("flax_orbax_plugin")]


def test_restore_params_first_use_loads_serving_alone_and_is_the_apis():
    code = (
        "import sys, flax_orbax_plugin as fop\n"
        "f = fop.restore_params\n"
        "alone = 'flax_orbax_plugin._api' not in sys.modules\n"
        "from flax_orbax_plugin import _api\n"
        "print(alone, f is _api.restore_params, fop.restore_params is f)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True", "True"]


def _imported_names(body):
    """The public names a module's imports bind (one bound to a private name, such as
    ``_api``'s ``named_keywords as _named_keywords``, is no public name)."""
    return sorted(
        (node.module, alias.name)
        for node in body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if not (alias.asname or alias.name).startswith("_")
    )


def test_public_names_agree_between_init_and_api():
    """``__all__`` (the names) and ``_api``'s imports (where each lives) are the two
    places a public name is written; type checkers read ``_api`` through ``__init__``."""
    pkg = os.path.join(REPO, "flax_orbax_plugin")
    init = ast.parse(open(os.path.join(pkg, "__init__.py")).read())
    block = next(
        n for n in init.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    assert [(n.module, [a.name for a in n.names]) for n in block.body][0] == ("_api", ["*"])
    api = ast.parse(open(os.path.join(pkg, "_api.py")).read())
    assert sorted(name for _, name in _imported_names(api.body)) == sorted(fop.__all__)
    for name in fop.__all__:
        assert getattr(fop, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        fop.no_such_name  # noqa: B018


def test_reading_commands_of_json_files_and_their_usage_errors_import_no_jax(tmp_path):
    """`flax-orbax list` (a few JSON files) imported JAX and tensorstore (2.6 s of its
    3 s), and so did a usage error a command finds (`verify --step 1 --all`). Each is
    checked as a shell runs it (`python -m flax_orbax_plugin`): neither is imported."""
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, {"params": {"w": list(range(3))}}, extras={"loss": 0.5})
    for argv, code in (
        (["list", run], 0),
        (["list", run, "--json"], 0),
        (["list", run / "1"], 0),
        (["verify", run, "--step", "1", "--all"], 2),
        # a command's own usage errors, said before it loads (issue 51 item 14)
        (["inspect", run, "--plot", "leaves.txt"], 2),
        (["list", run, "--plot", "saves.pdf"], 2),
        (["export", run, str(tmp_path / "m.safetensors"), "--cast", "unsafe"], 2),
        (["gc", run, "--keep-every", "2"], 2),
    ):
        got, out, imported = _python_m(*map(str, argv))
        assert got == code, (argv, got, out)
        heavy = sorted(m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "tensorstore"))
        assert not heavy, (argv, heavy[:5])
        # ml_dtypes (0.3-0.9 s) only where a dtype beyond numpy's is resolved
        assert "ml_dtypes" not in imported, argv
    assert "loss=0.5" in _python_m("list", str(run))[1]
