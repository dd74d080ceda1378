"""The python blocks of README.md and of the documentation pages (docs/*.md), with
the marker each carries on the line before it:

- ``<!-- snippet: run -->``: run by tests/docs/test_doc_examples.py, a page's blocks
  in order in one namespace, in a fresh working directory;
- ``<!-- snippet: first-start ... -->``: run by tests/manager/test_readme_snippets.py,
  with small real objects for the names the text around it supplies;
- ``<!-- snippet: run by tests/<path>.py::<test> -->``: run verbatim by that test;
- ``<!-- snippet: not run (why) -->``: needs what a test cannot start (several hosts).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import _paths

REPO = Path(_paths.REPO)
DOCS = REPO / "docs"
BLOCK = re.compile(r"^(?P<marker>[^\n]*)\n```python\n(?P<code>.*?)^```", re.M | re.S)
MARKER = re.compile(r"<!-- snippet: (?P<how>.+) -->")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository: README.md, docs/tutorial.md
    line: int  # of the block's first line of code
    how: str  # the marker's text: run, first-start ..., run by ..., not run (...)
    code: str


def pages() -> list[str]:
    """README.md and every page of the documentation site."""
    return ["README.md"] + [f"docs/{p.name}" for p in sorted(DOCS.glob("*.md"))]


def blocks(page: str) -> list[Block]:
    """Every python block of ``page``, in order; a block without a marker is an error."""
    text = (REPO / page).read_text()
    out = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code")) + 1
        marker = MARKER.fullmatch(m["marker"].strip())
        assert marker, f"{page}:{line}: a python block without a <!-- snippet: ... --> marker"
        out.append(Block(page, line, marker["how"], m["code"]))
    return out


def run_by(test: str) -> str:
    """The one block marked ``<!-- snippet: run by <test> -->`` on any page."""
    found = [b.code for page in pages() for b in blocks(page) if b.how == f"run by {test}"]
    assert len(found) == 1, f"{len(found)} blocks are marked 'run by {test}'"
    return found[0]
