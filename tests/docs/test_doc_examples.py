"""Every python block of the README and of the documentation pages runs in the suite.

A page's blocks marked ``<!-- snippet: run -->`` run here, in order, in one namespace
and a fresh working directory, as a reader pasting them into one session would run
them (the tutorial trains, stops, resumes and serves a run). A block marked ``run by
<test>`` must name a test that exists (that test runs it verbatim); ``not run (why)``
is kept for the few that need several hosts or an existing run, and counted. The
markers are read by ``tests/support/_docs.py``.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re

import _docs
import pytest

RUN_PAGES = sorted({b.page for p in _docs.pages() for b in _docs.blocks(p) if b.how == "run"})
NOT_RUN_AT_MOST = 6  # a few: several hosts, an existing Orbax run ...


def test_every_block_is_marked_with_a_way_it_runs():
    hows = [b for page in _docs.pages() for b in _docs.blocks(page)]
    assert len(hows) >= 20  # the tutorial's and the guides' blocks are there
    for b in hows:
        assert b.how == "run" or b.how.startswith(("first-start", "run by ", "not run (")), (
            f"{b.page}:{b.line}: unknown marker {b.how!r}"
        )
        compile(b.code, f"{b.page}:{b.line}", "exec")  # every block is Python
    not_run = [f"{b.page}:{b.line}" for b in hows if b.how.startswith("not run")]
    assert len(not_run) <= NOT_RUN_AT_MOST, not_run
    assert "docs/tutorial.md" in RUN_PAGES


def test_every_run_by_names_a_test_that_exists():
    for page in _docs.pages():
        for b in _docs.blocks(page):
            if not b.how.startswith("run by "):
                continue
            target = b.how.removeprefix("run by ")
            m = re.fullmatch(r"(tests/[\w/]+\.py)::(\w+)", target)
            assert m, f"{page}:{b.line}: 'run by' names no test: {target!r}"
            source = (_docs.REPO / m[1]).read_text()
            names = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
            assert m[2] in names, f"{page}:{b.line}: {m[1]} has no test {m[2]}"
            assert f'"{target}"' in source, (
                f"{page}:{b.line}: {m[1]} does not read the block it is named for"
            )


@pytest.mark.parametrize("page", RUN_PAGES)
def test_the_pages_blocks_run_in_order(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names: dict = {"__name__": "__doc_example__"}
    for b in _docs.blocks(page):
        if b.how != "run":
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile("\n" * (b.line - 1) + b.code, page, "exec"), names)


def test_the_api_reference_documents_every_public_name():
    """docs/api.md has an autodoc directive for each name of ``__all__`` (a new public
    name without one fails here; ``make docs`` fails on a name that does not exist)."""
    import flax_orbax_plugin as fop

    text = (_docs.DOCS / "api.md").read_text()
    documented = re.findall(r"^\.\. auto(?:function|class|exception):: (\w+)$", text, re.M)
    assert sorted(documented) == sorted(fop.__all__)


def test_the_readme_is_short_and_the_pages_name_no_issue_numbers():
    readme = (_docs.REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 350
    for page in [*_docs.pages(), "CHANGELOG.md"]:
        text = (_docs.REPO / page).read_text()
        assert not re.search(r"\bissues? \d+", text, re.I), page
