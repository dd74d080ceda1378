"""Declared options as a reader sees them: a signature for ``help()``, docstring lines,
the docs' markdown table. Built at import time and by the docs' tests.

Pure functions over frozen declarations; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.env``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from .env import Option

__all__ = ["doc_lines", "doc_table", "signature"]


def signature(
    leading: Iterable[inspect.Parameter], declared: Iterable[Option]
) -> inspect.Signature:
    """``leading`` (``self``, ``directory``...), then every declared option as a
    keyword-only parameter with its default and type."""
    options = [
        inspect.Parameter(
            o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.type_text
        )
        for o in declared
    ]
    return inspect.Signature([*leading, *options])


def doc_lines(declared: Iterable[Option], *, indent: str = "  ") -> str:
    """One line per declared option, ``name: doc (default: ...)``, for a docstring."""
    return "\n".join(
        f"{indent}{o.name}: {o.doc} (default: {_default_text(o.default)})" for o in declared
    )


def doc_table(declared: Iterable[Option]) -> str:
    """The declared options as a markdown table (docs/manager.md, tested to match)."""
    rows = ["| option | type | default | what it does |", "|---|---|---|---|"]
    for o in declared:
        kind = o.type_text.replace("|", "\\|")
        rows.append(f"| `{o.name}` | `{kind}` | `{_default_text(o.default)}` | {o.doc} |")
    return "\n".join(rows)


def _default_text(value: Any) -> str:
    name = getattr(value, "__qualname__", None)
    if callable(value) and name is not None:
        return f"{getattr(value, '__module__', '')}.{name}".lstrip(".")
    return repr(value)
