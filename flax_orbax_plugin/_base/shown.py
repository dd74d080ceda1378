"""Bounded lists in messages, and the ``stacklevel`` of the user's own call. Any thread."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

LIMIT = 8  # items a message names before "... and N more"
_ITEM_CHARS = 200  # one item's text at most (a name may be long too)


def listed(
    items: Iterable[Any], *, limit: int = LIMIT, fmt: Callable[[Any], str] = str, empty: str = ""
) -> str:
    """The first ``limit`` of ``items`` as ``fmt`` writes them (cut at 200 characters),
    then ``' ... and N more'``; ``empty`` when there are none."""
    shown: list[str] = []
    more = 0
    for item in items:
        if len(shown) < limit:
            text = fmt(item)
            shown.append(text if len(text) <= _ITEM_CHARS else text[: _ITEM_CHARS - 3] + "...")
        else:
            more += 1
    if not shown:
        return empty
    return ", ".join(shown) + (f" ... and {more} more" if more else "")


def gaps(present: Sequence[int], start: int = 0) -> list[tuple[int, int]]:
    """The ranges ``(first, last)`` of ints from ``start`` to ``max(present)`` that
    ``present`` (sorted, distinct) lacks: as many as ``present`` has, at most."""
    out = []
    expected = start
    for n in present:
        if n > expected:
            out.append((expected, n - 1))
        expected = max(expected, n + 1)
    return out


def number_ranges(ranges: Sequence[tuple[int, int]], *, limit: int = LIMIT) -> str:
    """``ranges`` (``(first, last)``, inclusive) as ``1, 3..999999``; past ``limit``
    ranges, ``... and N more ranges (M numbers)``."""
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in ranges[:limit])
    if len(ranges) > limit:
        rest = ranges[limit:]
        text += f" ... and {len(rest)} more ranges ({sum(b - a + 1 for a, b in rest)} numbers)"
    return text


def outside_stacklevel() -> int:
    """The ``stacklevel`` of a ``warnings.warn`` inside the package that names the first
    frame outside it and ``contextlib`` (the user's call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and (
        os.path.abspath(frame.f_code.co_filename).startswith(package)
        or frame.f_code.co_filename == contextlib.__file__
    ):
        frame, level = frame.f_back, level + 1
    return level
