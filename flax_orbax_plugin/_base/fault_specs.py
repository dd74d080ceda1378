"""The syntax of the test hooks' variables (``FOP_KILL_AT`` and its kin):
``phase[:N[:ERRNO]]``, parsed when one is set. Any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.env``.
"""

from __future__ import annotations

import errno
import re
from typing import NamedTuple


class FaultSpec(NamedTuple):
    """The phase, from its ``nth`` hit on, and the errno name of an injected error."""

    phase: str
    nth: int
    errno_name: str
    text: str


_PHASE = re.compile(r"[a-z][a-z0-9_-]*\Z")


def fault_spec(text: str, *, with_errno: bool) -> FaultSpec:
    parts = text.split(":")
    if len(parts) > (3 if with_errno else 2) or not _PHASE.match(parts[0]):
        raise ValueError("bad syntax")
    nth = parts[1] if len(parts) > 1 else "1"
    if not nth.isdigit() or int(nth) < 1:
        raise ValueError("bad hit count")
    name = parts[2] if len(parts) > 2 else "EIO"
    if not isinstance(getattr(errno, name, None), int) or not name.isupper():
        raise ValueError("bad errno name")
    return FaultSpec(parts[0], int(nth), name, text)
