"""Output of the command line: exit codes, one-line errors, tables, sizes, progress bars.

Progress bars go to stderr when it is a terminal; otherwise output is plain lines.
"""

from __future__ import annotations

import sys
import time
from typing import Any

EXIT_DAMAGED = 1


EXIT_ERROR = 2


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class Progress:
    """A one-line progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int, label: str, *, stream=None, unit: str = ""):
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and total > 0
        self.total, self.done, self.label, self.unit = total, 0, label, unit
        self._last = 0.0

    def advance(self, amount: int = 1, note: str = "") -> None:
        self.done += amount
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.05 and self.done < self.total:
            return
        self._last = now
        width = 30
        filled = int(width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "." * (width - filled)
        pct = 100.0 * self.done / self.total
        self.stream.write(f"\r{self.label} [{bar}] {pct:5.1f}% {note[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def make_table(rows: list[Any]) -> str:
    from clu import parameter_overview  # optional: clu only for this table

    return parameter_overview.make_table(rows)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
