"""Progress bars (on stderr when it is a terminal) and Markdown-style tables (never
wrapped on a pipe), drawn by ``rich``; loaded by the commands only (not by ``main``).
Not thread-safe: one command draws at a time.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

_WIDE = 10_000  # a table on a pipe is never wrapped


def _console() -> Console:
    """stderr's console (a pipe's never wraps)."""
    terminal = bool(getattr(sys.stderr, "isatty", lambda: False)())
    return Console(file=sys.stderr, width=None if terminal else _WIDE, highlight=False)


class ByteProgress:
    """A bar of ``total`` bytes on stderr when it is a terminal, else silent: a context
    manager with ``advance(nbytes, note)`` (the ``progress=`` protocol)."""

    def __init__(self, total: int, label: str):
        console = _console()
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[note]}"),
            console=console,
            disable=not console.is_terminal,
            transient=True,
        )
        self._task = self._bar.add_task(label, total=max(int(total), 1), note="")

    def advance(self, amount: int = 1, note: str = "") -> None:
        self._bar.update(self._task, advance=amount, note=note[:40])

    def __enter__(self) -> ByteProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.stop()


def byte_progress(label: str):
    """The ``progress=`` factory: total bytes -> a :class:`ByteProgress` of ``label``."""

    def factory(total: int, note: str = "") -> ByteProgress:
        return ByteProgress(total, f"{label} {note}".strip())

    return factory


def status(text: str):
    """A context manager: a spinner with ``text`` (a terminal only)."""
    console = _console()
    return console.status(text) if console.is_terminal else contextlib.nullcontext()


def make_table(rows: list[dict[str, Any]]) -> str:
    """Rows (dicts alike) as a Markdown-style table, a header of their keys."""
    table = Table(box=box.MARKDOWN, show_edge=True, pad_edge=True)
    for name in rows[0] if rows else ():
        table.add_column(Text(name), overflow="fold")
    for row in rows:
        table.add_row(*map(_cell, row.values()))
    console = Console(width=_WIDE, highlight=False, record=True, file=io.StringIO())
    console.print(table)
    lines = console.export_text().splitlines()
    return "\n".join(line.rstrip() for line in lines if line.strip())


def _cell(value: Any) -> Text:
    """Plain text (a leaf named ``[x]`` is no markup); an int with thousands commas."""
    number = isinstance(value, int) and not isinstance(value, bool)
    return Text(f"{value:,}" if number else str(value))
