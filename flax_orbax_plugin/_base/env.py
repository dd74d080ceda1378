"""The ``FOP_*`` environment variables the package reads, each declared once.

:func:`read` is the one place a ``FOP_*`` variable is read: its text is parsed and
checked against its declaration (:class:`~._base.option_spec.Option`), and a value it
does not take raises :class:`~flax_orbax_plugin.OptionError` naming the variable,
what it takes and what was found (never clamped, never ignored). Unset or empty: the
default. Read at each use (the fault specs and the thread priority) or once at import
(the coordination timeout, and liveness's two), on any thread.

Variables: ``FOP_BACKGROUND_NICE`` (``_base.priority``), ``FOP_COORDINATION_TIMEOUT_S``
(``_base.distributed``), ``FOP_PEER_SILENT_S`` and ``FOP_LATE_REPORT_S``
(``_base.liveness``), ``FOP_DIRECT_IO`` (``_zarr.chunk_writer``), ``FOP_KILL_AT`` and
``FOP_FAIL_AT`` (``_base.faults``: ``phase``, ``phase:N``, and for ``FOP_FAIL_AT``
``phase:N:ERRNO``), ``FOP_PAUSE_AT`` and ``FOP_PAUSE_S`` (test pause points),
``FOP_SLOW_AT`` and ``FOP_SLOW_S`` (test slow points). ``FOP_COORDINATION_TIMEOUT_S`` is
the default stall timeout (a manager's ``stall_timeout=`` overrides it).
"""

from __future__ import annotations

import errno
import os
import re
import threading
from typing import Any, NamedTuple

from .._errors import OptionError
from .option_spec import Option

__all__ = ["FaultSpec", "read", "VARIABLES"]


class FaultSpec(NamedTuple):
    """A parsed ``FOP_KILL_AT`` / ``FOP_FAIL_AT``: the phase, from its ``nth`` hit on,
    and (``FOP_FAIL_AT``) the errno name of the injected error."""

    phase: str
    nth: int
    errno_name: str
    text: str


_PHASE = re.compile(r"[a-z][a-z0-9_-]*\Z")


def _fault_spec(text: str, *, with_errno: bool) -> FaultSpec:
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


VARIABLES: dict[str, tuple[Option, Any]] = {
    "FOP_BACKGROUND_NICE": (Option("FOP_BACKGROUND_NICE", "int", low=0, high=19), 0),
    "FOP_COORDINATION_TIMEOUT_S": (
        Option(
            "FOP_COORDINATION_TIMEOUT_S",
            "number",
            low=0,
            low_open=True,
            high=threading.TIMEOUT_MAX,
            expected="a number of seconds > 0",
        ),
        300.0,
    ),
    "FOP_PEER_SILENT_S": (  # _base.liveness: a process silent this long is dead
        Option(
            "FOP_PEER_SILENT_S",
            "number",
            low=0.5,
            high=3600,
            expected="a number of seconds >= 0.5 and <= 3600",
        ),
        10.0,
    ),
    "FOP_LATE_REPORT_S": (  # _base.liveness: a wait this long names the late processes
        Option(
            "FOP_LATE_REPORT_S",
            "number",
            low=0.5,
            high=threading.TIMEOUT_MAX,
            expected="a number of seconds >= 0.5",
        ),
        10.0,
    ),
    "FOP_DIRECT_IO": (Option("FOP_DIRECT_IO", "choice", choices=("0", "1")), "1"),
    "FOP_KILL_AT": (
        Option(
            "FOP_KILL_AT",
            "custom",
            convert=lambda t: _fault_spec(t, with_errno=False),
            expected="a kill point: 'phase' or 'phase:N' (its N-th hit, N >= 1)",
        ),
        None,
    ),
    "FOP_PAUSE_AT": (  # test pause points (_faults.pause_point)
        Option(
            "FOP_PAUSE_AT",
            "custom",
            convert=lambda t: _fault_spec(t, with_errno=False),
            expected="a pause point: 'phase' or 'phase:N' (its N-th hit, N >= 1)",
        ),
        None,
    ),
    "FOP_SLOW_AT": (  # test slow points (_faults.slow_point): every pass from the Nth
        Option(
            "FOP_SLOW_AT",
            "custom",
            convert=lambda t: _fault_spec(t, with_errno=False),
            expected="a slow point: 'phase' or 'phase:N' (from its N-th hit, N >= 1)",
        ),
        None,
    ),
    "FOP_SLOW_S": (
        Option("FOP_SLOW_S", "number", low=0, high=3600, expected="seconds >= 0 and <= 3600"),
        1.0,
    ),
    "FOP_PAUSE_S": (
        Option("FOP_PAUSE_S", "number", low=0, high=3600, expected="seconds >= 0 and <= 3600"),
        2.0,
    ),
    "FOP_FAIL_AT": (
        Option(
            "FOP_FAIL_AT",
            "custom",
            convert=lambda t: _fault_spec(t, with_errno=True),
            expected="a fail point: 'phase', 'phase:N' or 'phase:N:ERRNO' (N >= 1, "
            "ERRNO an errno name such as EIO)",
        ),
        None,
    ),
}
"""name -> (declaration, default)."""

_PARSE = {"int": int, "number": float}


def read(name: str) -> Any:
    """The value of the environment variable ``name`` (one of :data:`VARIABLES`),
    checked; its default when unset or empty. OptionError for any other value."""
    option, default = VARIABLES[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = _PARSE.get(option.kind, str)(text)
        return option.check(value)
    except (ValueError, TypeError, OverflowError):
        raise OptionError(
            f"environment variable {name} must be {option.words}, found {text!r}"
        ) from None
