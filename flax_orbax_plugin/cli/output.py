"""Exit codes, one-line errors, sizes, times: the standard library only (the parser
imports this)."""

from __future__ import annotations

import datetime
import re
import shlex

EXIT_DAMAGED = 1
EXIT_ERROR = 2
EXIT_STORE = 3  # an object store refused: no such bucket, no credentials, access denied


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def iso_time(seconds: float) -> str:
    """A POSIX time as ISO 8601 in the local zone, to the second, with its offset."""
    local = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).astimezone()
    return local.isoformat(timespec="seconds")


def shell_word(path: object) -> str:
    """``path`` as one word of a command line the user may paste."""
    return shlex.quote(str(path))


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# The library's keywords that the command line takes as flags.
_FLAGS = {"memory_limit_bytes": "--memory-limit"}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAGS) + r")(=| >= )(\d+)( \(or None\))?")


def in_flag_words(text: str) -> str:
    """``text`` with each keyword the command line takes as a flag in the flag's words."""

    def flag(m: re.Match) -> str:
        name, how, figure, none = _FLAGS[m.group(1)], m.group(2), m.group(3), m.group(4)
        said = f"{name} {figure}" if how == "=" else f"{name} {figure} or more"
        return said + (" (or leave it out)" if none else "")

    return _KEYWORD.sub(flag, text)
