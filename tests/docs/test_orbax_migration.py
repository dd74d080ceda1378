"""The migration table of docs/orbax.md (Orbax's manager, ``ocp.args`` and v1 calls,
and ours): every line's equivalent runs, in the block under the table, and every
line is named there by its number."""

from __future__ import annotations

import re

import _docs

TEST = "tests/docs/test_orbax_migration.py::test_each_line_of_the_migration_table_runs"


def _table_lines() -> list[int]:
    text = (_docs.DOCS / "orbax.md").read_text()
    section = text.split("## From Orbax's calls to this library's", 1)[1].split("\n## ", 1)[0]
    return [int(n) for n in re.findall(r"^\| (\d+) \|", section, re.M)]


def test_each_line_of_the_migration_table_runs(tmp_path, monkeypatch):
    code = _docs.run_by(TEST)
    lines = _table_lines()
    assert lines == list(range(1, len(lines) + 1)) and len(lines) >= 20
    tested = {int(n) for n in re.findall(r"# \[(\d+)\]", code)}
    assert tested == set(lines), f"lines without a run equivalent: {set(lines) - tested}"
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/orbax.md", "exec"), {"__name__": "__doc_example__"})
