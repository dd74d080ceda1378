"""Output of the command line that the parser needs too: exit codes, one-line errors,
sizes, times. The standard library only (``--help`` and ``--version`` import this);
bars and tables are in ``display``, JSON documents in ``json_output``.
"""

from __future__ import annotations

import datetime
import re
import shlex

EXIT_DAMAGED = 1
EXIT_ERROR = 2
# An object store refused: no such bucket, no credentials, access denied (one line
# naming the bucket and what to do).
EXIT_STORE = 3


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def iso_time(seconds: float) -> str:
    """A POSIX time as ISO 8601 in the local zone, with its offset, to the second
    (``2026-12-02T05:31:07+00:00``): every time the CLI prints or writes as JSON."""
    local = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).astimezone()
    return local.isoformat(timespec="seconds")


def shell_word(path: object) -> str:
    """``path`` as one word of a command line the user may paste (a path with spaces or
    quotes is quoted; a plain one is unchanged)."""
    return shlex.quote(str(path))


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# The library's keywords that the command line takes as flags: a refusal raised by the
# library is said in the flag's words (the user typed --memory-limit, not the keyword).
_FLAGS = {"memory_limit_bytes": "--memory-limit"}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAGS) + r")(=| >= )(\d+)( \(or None\))?")


def in_flag_words(text: str) -> str:
    """``text`` (a library error's one line) with each keyword the command line takes as
    a flag written as that flag: ``memory_limit_bytes=N`` as ``--memory-limit N``,
    ``give memory_limit_bytes >= N (or None)`` as ``give --memory-limit N or more (or
    leave it out)``."""

    def flag(m: re.Match) -> str:
        name, how, figure, none = _FLAGS[m.group(1)], m.group(2), m.group(3), m.group(4)
        said = f"{name} {figure}" if how == "=" else f"{name} {figure} or more"
        return said + (" (or leave it out)" if none else "")

    return _KEYWORD.sub(flag, text)
