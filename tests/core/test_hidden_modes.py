"""No mode travels hidden: the lint rules of tools/state_scan.py, on the package and on
a package made to break them (so the rules can fail)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))

import state_scan  # noqa: E402  (tools/ is no package: on sys.path above)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "flax_orbax_plugin"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOLS / "import_graph.py"), str(root), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def package_scan():
    """The scan of the package (read only: the tests below only look at its lists)."""
    return state_scan.scan(ROOT / "flax_orbax_plugin")


def test_the_package_has_no_hidden_mode(package_scan):
    contexts, state, _ = package_scan
    assert contexts == []  # none allowed: a collective region is an argument too
    assert state_scan.hidden_modes(contexts, state) == []
    assert _check(ROOT / "flax_orbax_plugin").returncode == 0


@pytest.mark.parametrize(
    "text",
    [
        "import contextvars\nMODE = contextvars.ContextVar('m', default=None)\n",
        "import threading\n_LOCAL = threading.local()\n",
        "_SEEN = []\ndef f(x):\n    _SEEN.append(x)\n",
        "_BY = {}\ndef f(k):\n    _BY[k] = 1\n",
        "_N = 0\ndef f():\n    global _N\n    _N += 1\n",
    ],
    ids=["contextvar", "thread-local", "list-appended", "dict-item-set", "global-rebound"],
)
def test_a_hidden_mode_fails_the_check(tmp_path, text):
    root = _package(tmp_path, {"_core/__init__.py": "", "_core/mode.py": text})
    contexts, state, _ = state_scan.scan(root)
    assert len(contexts + state) == 1
    done = _check(root)
    assert done.returncode == 1
    assert "hidden mode" in done.stderr and "_core.mode" in done.stderr


@pytest.mark.parametrize(
    ("module", "text"),
    [
        # a name the allow-list holds (module-level state) is no licence for one
        ("_base/distributed.py", "import threading\n_SESSION = threading.local()\n"),
        ("_base/regions.py", "import threading\n_LOCAL = threading.local()\n"),
        (
            "_core/mode.py",
            "import threading\nclass Reader:\n    def __init__(self):\n"
            "        self.scratch = threading.local()\n",
        ),
        ("_core/mode.py", "import contextvars\nclass C:\n    MODE = contextvars.ContextVar('m')\n"),
        ("_core/mode.py", "from threading import local\nclass Stack(local):\n    pass\n"),
    ],
    ids=["allow-listed-name", "regions-stack", "on-an-instance", "in-a-class", "subclassed"],
)
def test_a_context_variable_is_never_allowed(tmp_path, module, text):
    root = _package(tmp_path, {"_base/__init__.py": "", "_core/__init__.py": "", module: text})
    contexts, state, _ = state_scan.scan(root)
    assert len(contexts) == 1 and state_scan.hidden_modes(contexts, state) == contexts
    done = _check(root)
    assert done.returncode == 1
    dotted = module.removesuffix(".py").replace("/", ".")
    assert "hidden mode" in done.stderr and dotted in done.stderr


def test_the_package_tests_no_format_version_outside_the_seam(package_scan):
    *_, tests = package_scan
    assert state_scan.outside_seam(tests) == []
    assert any(t[0] == "flax_orbax_plugin._core.formats" for t in tests)  # it looks


@pytest.mark.parametrize(
    "text",
    [
        "def f(doc):\n    return 1 if doc.format_version == 2 else 0\n",
        "def f(opts):\n    return opts['format_version'] != 1\n",
        "def f(direct):\n    if direct.packed:\n        return 1\n",
    ],
    ids=["attribute", "option-key", "packed-branch"],
)
def test_a_version_test_outside_the_seam_fails_the_check(tmp_path, text):
    root = _package(
        tmp_path,
        {
            "_core/__init__.py": "",
            "_core/plan.py": text,
            "_core/formats.py": "def f(doc):\n    return doc.format_version == 2\n",
        },
    )
    *_, tests = state_scan.scan(root)
    assert [t[0] for t in state_scan.outside_seam(tests)] == ["flax_orbax_plugin._core.plan"]
    done = _check(root)
    assert done.returncode == 1 and "_core.plan" in done.stderr
    assert "_core.formats" not in done.stderr


def test_a_constant_table_is_no_state(tmp_path):
    text = "TABLE = {}\nfor k in 'ab':\n    TABLE[k] = 1\nNAMES = ['x']\n"
    root = _package(tmp_path, {"_core/__init__.py": "", "_core/table.py": text})
    assert state_scan.scan(root)[:2] == ([], [])
    assert _check(root).returncode == 0


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("def f():\n    import json\n    return json\n", False),
        ("def f():\n    import json  # here: only when asked\n    return json\n", True),
        (
            "def f():\n    # optional: json only here\n    try:\n        import json\n"
            "        import csv\n    except ImportError:\n        return None\n",
            True,
        ),
    ],
    ids=["bare", "commented", "comment-above-try"],
)
def test_an_import_inside_a_function_needs_a_comment(tmp_path, text, ok):
    root = _package(tmp_path, {"_core/__init__.py": "", "_core/late.py": text})
    done = _check(root)
    assert (done.returncode == 0) is ok, done.stderr
    if not ok:
        assert "import inside a function at flax_orbax_plugin._core.late:2" in done.stderr
