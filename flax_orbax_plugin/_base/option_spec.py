"""Options declared once: each public option's type, range and allowed values.

An :class:`Option` is one keyword option (or ``FOP_*`` environment variable) as
declared by the module that owns it (``_core.save_options`` for ``fop.save``,
``_manager.options`` for the manager, the callback and the tier); :func:`check`
checks the values given by name against their declarations, where they enter, and
raises :class:`~flax_orbax_plugin.OptionError` (a ValueError) or
:class:`~flax_orbax_plugin.OptionTypeError` (also a TypeError) naming the option,
what it takes and what was found, with the closest allowed string where one is close.
:func:`refuse_without` refuses an option that does nothing in the chosen mode.

Pure functions over frozen records; any thread.
"""

from __future__ import annotations

import difflib
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import CheckpointError, OptionError, OptionTypeError

__all__ = ["Option", "check", "found", "refuse_without", "INT64_MAX"]

INT64_MAX = (1 << 63) - 1  # sizes and counts handed to tensorstore or the OS


def found(value: Any) -> str:
    """``value`` as an error message shows it: its type and a short repr."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


@dataclass(frozen=True)
class Option:
    """One option: ``kind`` is ``"int"`` (an integer scalar, not a bool), ``"number"`` (an int or
    a float, not a bool; never NaN or infinite), ``"flag"`` (True or False),
    ``"choice"`` (one of ``choices``), ``"str"`` (a non-empty str), ``"callable"``,
    or ``"custom"`` (``convert`` alone decides). ``low`` / ``high`` bound numbers
    (``low_open``: strictly above ``low``); ``none_ok``: None is allowed;
    ``convert(value) -> value`` runs last (it raises ValueError / TypeError with its
    own words, which :func:`check` prefixes with the option's name); ``expected``: the
    words of the messages (derived from the declaration when empty)."""

    name: str
    kind: str
    none_ok: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple = ()
    convert: Callable[[Any], Any] | None = None
    expected: str = ""
    words: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", self.expected or self._derived_words())

    def _derived_words(self) -> str:
        if self.kind == "choice":
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind == "flag":
            text = "True or False"
        elif self.kind == "str":
            text = "a non-empty str"
        elif self.kind == "callable":
            text = "a callable"
        else:
            noun = "an int" if self.kind == "int" else "a finite number"
            bounds = []
            if self.low is not None:
                bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
            if self.high is not None:
                bounds.append(f"<= {self.high:g}")
            text = noun + (f" {' and '.join(bounds)}" if bounds else "")
        return text + (" or None" if self.none_ok else "")

    def check(self, value: Any) -> Any:
        """``value`` checked (as ``convert`` returns it); OptionError otherwise."""
        if value is None and self.none_ok:
            return None
        getattr(self, f"_check_{self.kind}", lambda v: None)(value)
        if self.kind in _PLAIN:  # numpy scalars as Python's
            value = _PLAIN[self.kind](value)
        if self.convert is None:
            return value
        try:
            return self.convert(value)
        except CheckpointError:  # the library's own (OptionError, a path checker's): as is
            raise
        except TypeError as e:
            raise OptionTypeError(f"{self.name}: {e}") from None
        except ValueError as e:
            raise OptionError(f"{self.name}: {e}") from None

    def _fail(self, value: Any, *, wrong_type: bool, hint: str = "") -> None:
        cls = OptionTypeError if wrong_type else OptionError
        raise cls(f"{self.name} must be {self.words}, found {found(value)}{hint}")

    def _check_int(self, value: Any) -> None:
        """An int, or an integer scalar with ``__index__`` (numpy, a jax array)."""
        if isinstance(value, bool):
            self._fail(value, wrong_type=True)
        try:
            number = operator.index(value)
        except TypeError:
            self._fail(value, wrong_type=True)
        self._check_range(number)

    def _check_number(self, value: Any) -> None:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            self._fail(value, wrong_type=True)
        if not math.isfinite(value):
            self._fail(value, wrong_type=False)
        self._check_range(value)

    def _check_range(self, value: Any) -> None:
        low, high = self.low, self.high
        if low is not None and (value <= low if self.low_open else value < low):
            self._fail(value, wrong_type=False)
        if high is not None and value > high:
            self._fail(value, wrong_type=False)

    def _check_flag(self, value: Any) -> None:
        if not isinstance(value, bool):
            self._fail(value, wrong_type=True)

    def _check_str(self, value: Any) -> None:
        if not isinstance(value, str):
            self._fail(value, wrong_type=True)
        if not value:
            self._fail(value, wrong_type=False)

    def _check_callable(self, value: Any) -> None:
        if not callable(value):
            self._fail(value, wrong_type=True)

    def _check_choice(self, value: Any) -> None:
        for choice in self.choices:  # 1 is not True, 1.0 is not 1: type and value
            if type(value) is type(choice) and value == choice:
                return
        hint = ""
        if isinstance(value, str):
            names = [c for c in self.choices if isinstance(c, str)]
            close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        self._fail(value, wrong_type=False, hint=hint)


_PLAIN = {"int": operator.index, "number": float}


def check(declared: Iterable[Option], values: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of ``declared`` present in ``values`` checked, by its name:
    ``{name: checked value}``; the first bad one raises OptionError naming it."""
    out = {}
    for option in declared:
        if option.name in values:
            out[option.name] = option.check(values[option.name])
    return out


def refuse_without(option: str, value: Any, needs: str, *, default: Any = None) -> None:
    """Refuses ``option`` given (``value`` is not ``default``) in a mode where it does
    nothing: OptionError naming the option, its value and ``needs`` (the mode it needs,
    as the message says it: ``"format_version=2"``)."""
    if value is default or (default is not None and value == default):
        return
    raise OptionError(f"{option}={value!r} does nothing without {needs}")
