"""The host-memory ceiling's options: ``host_memory`` (a manager's, a callback's) and
``host_memory_budget`` (``fop.save``'s, and ``host_memory``'s earlier name) declared,
the ceiling's converter, the earlier name taken with a warning, and the refusals of
options that do nothing beside a ceiling of bytes. Used where options are checked (a
manager's or callback's construction); what a ceiling allows at each save is
``_base.host`` (``resolve``, ``save_budget``).

Pure functions over frozen declarations; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.host``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from .._errors import OptionError
from .env import INT64_MAX, Option, check, found, outside_stacklevel, refuse_without
from .host import AUTO

__all__ = ["HOST_MEMORY", "HOST_MEMORY_BUDGET", "check_ceiling", "refuse_idle", "take_old_name"]


def check_ceiling(value: Any) -> int | str | None:
    """``value`` if it is a ceiling: a positive int (bytes, at most 2**63-1), ``"auto"``
    or None; else ValueError / TypeError in the words of an option's message."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        index = getattr(value, "__index__", None)  # numpy integer scalars
        if index is None or isinstance(value, bool):
            expected = "expected a positive int of bytes, 'auto' or None"
            raise TypeError(f"{expected}, found {found(value)}")
        value = index()
    if not 1 <= value <= INT64_MAX:
        raise ValueError(f"expected a positive int of bytes <= {INT64_MAX}, found {value}")
    return int(value)


HOST_MEMORY = Option(
    "host_memory",
    "custom",
    none_ok=True,
    convert=check_ceiling,
    default=AUTO,
    annotation="int | str",
    doc="the host-memory ceiling, bytes any save, restore or resume holds beyond "
    "the state: an int (a save streams under it), 'auto' (half the memory free when a save "
    "starts: it streams only when the state does not fit) or None (no bound)",
)
"""A manager's (and a callback's) one ceiling (docs/manager.md, "Host memory")."""

HOST_MEMORY_BUDGET = Option(  # fop.save's, and the manager's host_memory by its old name
    "host_memory_budget",
    "int",
    none_ok=True,
    low=1,
    high=INT64_MAX,
    expected=f"a positive int <= {INT64_MAX} or None",
    doc="host bytes a step may hold beyond the state (None: no bound)",
)


def take_old_name(given: Mapping[str, Any], owner: str = "") -> dict[str, Any]:
    """``given`` (a manager's keyword options) with ``host_memory_budget=``, the earlier
    name of ``host_memory``, checked by its declaration and turned into
    ``host_memory=`` with a DeprecationWarning; both given is an OptionError naming
    both. ``owner``: the words before the name in messages."""
    old = HOST_MEMORY_BUDGET.name
    if old not in given:
        return dict(given)
    value = check((HOST_MEMORY_BUDGET,), {old: given[old]})[old]
    if "host_memory" in given:
        raise OptionError(
            f"{owner}{old}={given[old]!r} and host_memory={given['host_memory']!r} are one "
            f"option ({old}= is its earlier name): give host_memory= alone"
        )
    warnings.warn(
        f"{owner}{old}=: deprecated, and gone in the next release; write host_memory={value!r}",
        DeprecationWarning,
        stacklevel=outside_stacklevel(),
    )
    out = {k: v for k, v in given.items() if k != old}
    out["host_memory"] = value
    return out


def refuse_idle(out: Mapping[str, Any]) -> None:
    """A manager's checked options ``out``: the host-memory options that do nothing
    beside another refused, naming both: a ceiling of bytes with incremental steps
    (they copy every region to host first; ``"auto"`` then streams no save),
    ``reuse_host_buffers=True`` under a ceiling of bytes (each save streams: nothing
    is pooled)."""
    ceiling = out["host_memory"]
    if not isinstance(ceiling, int):
        return
    if out["incremental"]:
        needs = "incremental=False (an incremental step copies every region to host first)"
        refuse_without("host_memory", ceiling, needs)
    refuse_without(
        "reuse_host_buffers",
        out["reuse_host_buffers"],
        "host_memory=None or 'auto' (under a ceiling of bytes nothing is pooled: each "
        "save streams, CPU arrays are written from their own memory)",
        default=False,
    )
