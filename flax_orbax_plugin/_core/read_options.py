"""The keyword options of the read entry points (``fop.restore``, ``fop.verify``,
``fop.restore_params``), each declared once, as ``save_options`` declares the save's.

:func:`check_restore`, :func:`check_verify` and :func:`check_serving` check them by
name where they enter (each function's first act, before anything is read): a value of
the wrong type, out of range, NaN or huge is an OptionError naming the option, what it
takes and what was found; ``step=`` with ``all_steps=True`` (where it does nothing) is
refused naming both. ``cast``, ``partial``, ``missing`` and ``transform`` keep the
checkers of their owners (``_like``).
"""

from __future__ import annotations

from typing import Any

from .._base.option_spec import Option, check
from .._errors import OptionError
from .._format.steps import STEP_OR_NONE
from .save_options import MEMORY_LIMIT

__all__ = ["check_restore", "check_serving", "check_verify"]


RESTORE: tuple[Option, ...] = (
    MEMORY_LIMIT,
    Option("share_replicated_reads", "flag", none_ok=True, expected="True, False or None"),
)
VERIFY: tuple[Option, ...] = (STEP_OR_NONE, Option("all_steps", "flag"))
SERVING: tuple[Option, ...] = (STEP_OR_NONE,)


def check_restore(**options: Any) -> dict[str, Any]:
    """``fop.restore``'s options of :data:`RESTORE`, checked."""
    return check(RESTORE, options)


def check_verify(**options: Any) -> dict[str, Any]:
    """``fop.verify``'s options, checked; ``step`` with ``all_steps`` refused."""
    out = check(VERIFY, options)
    if out["all_steps"] and out["step"] is not None:
        raise OptionError(
            f"step={out['step']} and all_steps=True conflict: all_steps verifies every "
            "step, step= one of them; give one of the two"
        )
    return out


def check_serving(**options: Any) -> dict[str, Any]:
    """``fop.restore_params``'s options of :data:`SERVING`, checked."""
    return check(SERVING, options)
