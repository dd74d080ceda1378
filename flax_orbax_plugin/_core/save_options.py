"""The keyword options of ``fop.save`` / ``fop.save_async``, each declared once.

:func:`check_save` checks them by name where they enter (the first act of
``save_async``, on the caller's thread, before anything is written or waited for):
a value of the wrong type, out of range, NaN, empty or unknown is an OptionError
naming the option, what it takes and what was found; ``data_file_bytes`` with format
version 1 (one file per chunk: it does nothing there) is refused naming both.
"""

from __future__ import annotations

from typing import Any

from .._base.option_spec import INT64_MAX, Option, check, refuse_without
from .._format import layout as _layout
from . import formats as _formats

__all__ = ["MEMORY_LIMIT", "SAVE", "check_save"]

# The host-memory limit of a save's or a read's copies: one declaration for both.
MEMORY_LIMIT = Option(
    "memory_limit_bytes",
    "int",
    none_ok=True,
    low=1,
    high=INT64_MAX,
    expected=f"a positive int <= {INT64_MAX} or None",
)


def _codec(value: Any) -> str | None:
    return _layout.check_codec(value, where="compression")


SAVE: tuple[Option, ...] = (
    Option("force", "flag"),
    MEMORY_LIMIT,
    Option(
        "compression",
        "str",
        none_ok=True,
        convert=_codec,
        expected="None, 'zstd' or 'zstd:<level 1-22>'",
    ),
    Option("format_version", "choice", choices=(1, 2)),
    Option(
        "data_file_bytes",
        "int",
        none_ok=True,
        low=1,
        high=INT64_MAX,
        expected=f"a positive int <= {INT64_MAX} or None",
    ),
    Option("host_memory_budget", "int", none_ok=True, low=1, expected="a positive int or None"),
)


def check_save(**options: Any) -> dict[str, Any]:
    """Every option of :data:`SAVE` given by name, checked; ``{name: checked value}``."""
    out = check(SAVE, options)
    # What the chosen format ignores is refused (the format says what, and why).
    _formats.refuse_ignored(
        out["format_version"], out, lambda name, needs: refuse_without(name, out[name], needs)
    )
    return out
