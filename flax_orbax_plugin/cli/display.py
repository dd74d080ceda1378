"""What a command draws: progress bars (stderr, a terminal only) and Markdown-style tables
(never wrapped on a pipe) by ``rich``; ``--plot`` figures by matplotlib (optional; no global
figure), written under a temporary name and renamed. Loaded by the commands only; one
command draws at a time (not thread-safe)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import os
import secrets
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

from .._format.steps import holding_checkpoint
from .._storage.location import Location
from .main import PLOT_FORMATS
from .output import CliError, human_bytes

_WIDE = 10_000  # a table on a pipe is never wrapped


def _console() -> Console:
    terminal = bool(getattr(sys.stderr, "isatty", lambda: False)())
    return Console(file=sys.stderr, width=None if terminal else _WIDE, highlight=False)


class ByteProgress:
    """A bar of ``total`` bytes on stderr (a terminal only): the ``progress=`` protocol."""

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


TOP_LEAVES = 30  # the largest leaves drawn; the rest are one "other" bar per item


@dataclasses.dataclass(frozen=True)
class Bar:
    label: str  # a leaf: item/path
    item: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Save:
    step: int
    time: float
    written: int | None
    reused: int | None


def check_output(path: str) -> None:
    """A CliError naming ``--plot`` unless matplotlib is found and the place is allowed."""
    _figure_class()
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CliError(f"--plot {path!r}: no such directory {directory!r}")
    held = holding_checkpoint(Location.from_path(os.path.realpath(directory)), runs=2)
    if held is not None:
        raise CliError(f"--plot {path!r}: lies inside {held}; write the picture elsewhere")


def _figure_class() -> Any:
    try:
        # here: matplotlib is optional and slow to import
        from matplotlib.figure import Figure
    except ImportError:
        raise CliError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or flax_orbax_plugin[plot])"
        ) from None
    return Figure


def leaves_figure(title: str, bars: list[Bar], path: str) -> None:
    """Bars of the ``TOP_LEAVES`` largest leaves (a colour per item), the rest summed."""
    bars = sorted(bars, key=lambda b: -b.nbytes)
    shown, rest = bars[:TOP_LEAVES], bars[TOP_LEAVES:]
    for item in sorted({b.item for b in rest}):
        n = [b for b in rest if b.item == item]
        shown.append(Bar(f"{item}/ ({len(n)} more leaves)", item, sum(b.nbytes for b in n)))
    items = sorted({b.item for b in shown})
    fig = _figure_class()(figsize=(9, 1.5 + 0.28 * max(len(shown), 1)), layout="constrained")
    ax = fig.add_subplot()
    colours = {item: f"C{i % 10}" for i, item in enumerate(items)}
    rows = list(reversed(shown))
    colour_of_row = [colours[b.item] for b in rows]
    ax.barh([b.label for b in rows], [b.nbytes for b in rows], color=colour_of_row)
    for item in items:
        ax.bar(0, 0, color=colours[item], label=item)  # a legend entry per item
    sizes = [b.nbytes for b in shown if b.nbytes > 0]
    if sizes and max(sizes) > 1000 * min(sizes):
        ax.set_xscale("log")  # a kernel beside a bias: both readable
    ax.set_xlabel("bytes")
    total = sum(b.nbytes for b in bars)
    ax.set_title(f"{title}: {len(bars)} leaves, {human_bytes(total)}")
    if items:
        ax.legend(loc="lower right")
    _write(fig, path)


def saves_figure(title: str, saves: list[Save], path: str) -> None:
    """Bytes written and reused by each step's save, against the time it was saved."""
    fig = _figure_class()(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    times = [datetime.datetime.fromtimestamp(s.time).astimezone() for s in saves]
    written = [s.written or 0 for s in saves]
    reused = [s.reused or 0 for s in saves]
    ax.plot(times, written, marker="o", label="bytes written")
    if any(reused):
        ax.plot(times, reused, marker="s", label="bytes reused (incremental)")
    for t, w, s in zip(times, written, saves, strict=True):
        ax.annotate(str(s.step), (t, w), textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_xlabel("saved at (local time)")
    ax.set_ylabel("bytes")
    ax.set_title(f"{title}: {len(saves)} step(s)")
    ax.legend()
    fig.autofmt_xdate()
    _write(fig, path)


def _write(fig: Any, path: str) -> None:
    fmt = PLOT_FORMATS[os.path.splitext(path)[1].lower()]
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".plot-{secrets.token_hex(8)}.{fmt}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)  # umask
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
