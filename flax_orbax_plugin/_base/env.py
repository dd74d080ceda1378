"""Options and ``FOP_*`` environment variables declared once; fail points and background priority.

Pure functions over frozen records, any thread; ``read`` parses a variable at each use
(once at import: the coordination timeout and liveness's two).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.env``.
"""

from __future__ import annotations

import collections
import difflib
import errno
import math
import numbers
import operator
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import CheckpointError, OptionError, OptionTypeError
from .fault_specs import FaultSpec, fault_spec

INT64_MAX = (1 << 63) - 1  # sizes and counts handed to tensorstore or the OS


def found(value: Any) -> str:
    """``value`` as an error message shows it: its type and a short repr."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


@dataclass(frozen=True)
class Option:
    """One option: ``kind`` is ``"int"`` (not a bool), ``"number"`` (int or float, not a
    bool, finite), ``"flag"``, ``"choice"`` (one of ``choices``), ``"str"`` (non-empty),
    ``"callable"`` or ``"custom"`` (``convert`` alone decides). ``low`` / ``high`` bound
    numbers (``low_open``: strictly above); ``none_ok``: None allowed; ``convert`` runs
    last (its ValueError / TypeError prefixed with the name); ``expected``: the messages'
    words (derived when empty); ``default``; ``doc``: one line for docstrings and docs;
    ``aliases``: other libraries' names an unknown keyword is pointed from;
    ``annotation``: the signature's type (derived from ``kind`` when empty)."""

    name: str
    kind: str
    none_ok: bool = False
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple = ()
    convert: Callable[[Any], Any] | None = None
    expected: str = ""
    default: Any = None
    doc: str = ""
    aliases: tuple[str, ...] = ()
    annotation: str = ""
    words: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", self.expected or self._derived_words())

    def _derived_words(self) -> str:
        if self.kind == "choice":
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind in _WORDS:
            text = _WORDS[self.kind]
        else:
            noun = "an int" if self.kind == "int" else "a finite number"
            bounds = []
            if self.low is not None:
                bounds.append(f"{'>' if self.low_open else '>='} {self.low:g}")
            if self.high is not None:
                bounds.append(f"<= {self.high:g}")
            text = noun + (f" {' and '.join(bounds)}" if bounds else "")
        return text + (" or None" if self.none_ok else "")

    @property
    def type_text(self) -> str:
        """The type as the signature shows it (``int | None``)."""
        text = self.annotation or _ANNOTATIONS.get(self.kind, "Any")
        return text + (" | None" if self.none_ok and text not in ("Any", "None") else "")

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
        except (TypeError, ValueError) as e:  # named once (a converter may name it too)
            text = str(e) if str(e).startswith(self.name) else f"{self.name}: {e}"
            cls = OptionTypeError if isinstance(e, TypeError) else OptionError
            raise cls(text) from None

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
        below = low is not None and (value <= low if self.low_open else value < low)
        if below or (high is not None and value > high):
            self._fail(value, wrong_type=False)

    def _check_flag(self, value: Any) -> None:
        if not isinstance(_plain(value), bool):  # 1 and "no" are no flags; np.True_ is
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
            if type(_plain(value)) is type(choice) and _plain(value) == choice:
                return
        hint = ""
        if isinstance(value, str):
            names = [c for c in self.choices if isinstance(c, str)]
            close = difflib.get_close_matches(value, names, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        self._fail(value, wrong_type=False, hint=hint)


def _plain(value: Any) -> Any:
    """A numpy bool or integer scalar as Python's (without importing numpy); else as is."""
    numpy = type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0
    if numpy and getattr(value.dtype, "kind", None) in ("b", "i", "u"):
        return value.item()
    return value


_WORDS = {"flag": "True or False", "str": "a non-empty str", "callable": "a callable"}
_PLAIN = {"int": operator.index, "number": float, "flag": bool, "choice": _plain}
_ANNOTATIONS = {
    "int": "int",
    "number": "float",
    "flag": "bool",
    "str": "str",
    "callable": "Callable",
}


def check(declared: Iterable[Option], values: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: checked value}`` of the options of ``declared`` present in ``values``."""
    out = {}
    for option in declared:
        if option.name in values:
            out[option.name] = option.check(values[option.name])
    return out


def flag(name: str, value: Any) -> bool:
    """``value`` of the flag ``name`` as a bool; 1, "no" or None: OptionTypeError."""
    return Option(name, "flag").check(value)


def _point(
    name: str, what: str, *, hit: str = "its N-th hit", with_errno: bool = False
) -> tuple[Option, None]:
    """A test hook's variable, unset by default: a ``what`` point's phase and hit count."""
    syntax = f"'phase' or 'phase:N' ({hit}, N >= 1)"
    if with_errno:
        syntax = "'phase', 'phase:N' or 'phase:N:ERRNO' (N >= 1, ERRNO an errno name such as EIO)"
    convert = lambda t: fault_spec(t, with_errno=with_errno)
    return Option(name, "custom", convert=convert, expected=f"a {what} point: {syntax}"), None


def _seconds(
    name: str,
    default: float,
    *,
    low: float,
    high: float = threading.TIMEOUT_MAX,
    above: bool = False,
) -> tuple[Option, float]:
    """A variable of seconds; its words name ``high`` only where it is below Python's own."""
    words = f"a number of seconds {'>' if above else '>='} {low:g}"
    words += f" and <= {high:g}" if high < threading.TIMEOUT_MAX else ""
    option = Option(name, "number", low=low, high=high, low_open=above, expected=words)
    return option, default


VARIABLES: dict[str, tuple[Option, Any]] = {
    "FOP_BACKGROUND_NICE": (Option("FOP_BACKGROUND_NICE", "int", low=0, high=19), 0),
    "FOP_COORDINATION_TIMEOUT_S": _seconds("FOP_COORDINATION_TIMEOUT_S", 300.0, low=0, above=True),
    # _base.regions: a process silent this long is dead
    "FOP_PEER_SILENT_S": _seconds("FOP_PEER_SILENT_S", 10.0, low=0.5, high=3600),
    # _base.regions: a wait this long names the late processes
    "FOP_LATE_REPORT_S": _seconds("FOP_LATE_REPORT_S", 10.0, low=0.5),
    "FOP_DIRECT_IO": (Option("FOP_DIRECT_IO", "choice", choices=("0", "1")), "1"),
    # _base.host: a save or restore under Pathways (single controller): refused
    "FOP_PATHWAYS": (Option("FOP_PATHWAYS", "choice", choices=("refuse", "allow")), "refuse"),
    # _storage.location: how a step commits on a local path (auto: a file on FUSE mounts)
    "FOP_COMMIT": (Option("FOP_COMMIT", "choice", choices=("auto", "rename", "file")), "auto"),
    # _storage.contexts: retries of an object store request (0.5 s doubling to 10 s)
    "FOP_STORE_RETRIES": (Option("FOP_STORE_RETRIES", "int", low=0, high=100), 8),
    "FOP_TIER_RETRY_DELAY_S": (Option("FOP_TIER_RETRY_DELAY_S", "number", low=0, high=60), 0.5),
    "FOP_KILL_AT": _point("FOP_KILL_AT", "kill"),
    "FOP_PAUSE_AT": _point("FOP_PAUSE_AT", "pause"),
    "FOP_SLOW_AT": _point("FOP_SLOW_AT", "slow", hit="from its N-th hit"),
    "FOP_SLOW_S": _seconds("FOP_SLOW_S", 1.0, low=0, high=3600),
    "FOP_PAUSE_S": _seconds("FOP_PAUSE_S", 2.0, low=0, high=3600),
    "FOP_FAIL_AT": _point("FOP_FAIL_AT", "fail", with_errno=True),
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


# -- fail points (tests) --------------------------------------------------------------

_HITS: collections.Counter[str] = collections.Counter()


class InjectedFault(OSError):
    """The failure ``FOP_FAIL_AT`` asked for (its ``errno`` as asked, EIO by default)."""

    def __str__(self) -> str:
        return str(self.strerror)


def _reached(variable: str, phase: str, key: str) -> FaultSpec | None:
    """The spec in ``variable`` when it names ``phase`` and this is its Nth hit."""
    spec = read(variable)
    if spec is None or spec.phase != phase:
        return None
    _HITS[key] += 1
    return spec if _HITS[key] >= spec.nth else None


def kill_point(phase: str) -> None:
    if _reached("FOP_KILL_AT", phase, phase):
        os.kill(os.getpid(), signal.SIGKILL)


def fail_point(phase: str) -> None:
    spec = _reached("FOP_FAIL_AT", phase, f"fail:{phase}")
    if spec:
        code = getattr(errno, spec.errno_name)
        raise InjectedFault(code, f"injected fault at {phase} (FOP_FAIL_AT={spec.text})")


def pause_point(phase: str) -> None:
    """``FOP_PAUSE_AT=<phase>[:<nth>]``: at the Nth pass, writes ``FOP_PAUSED <phase>``
    to stderr and sleeps ``FOP_PAUSE_S`` seconds (a test's window for a real signal)."""
    if _reached("FOP_PAUSE_AT", phase, f"pause:{phase}"):
        os.write(2, f"FOP_PAUSED {phase}\n".encode())
        time.sleep(read("FOP_PAUSE_S"))


def slow_point(phase: str) -> None:
    """``FOP_SLOW_AT=<phase>[:<nth>]``: from the Nth pass on, every pass sleeps
    ``FOP_SLOW_S`` seconds (a test's slow but progressing write or read)."""
    if _reached("FOP_SLOW_AT", phase, f"slow:{phase}"):
        time.sleep(read("FOP_SLOW_S"))


# -- background priority -----------------------------------------------------------------


def lower() -> None:
    """Lowers the calling thread's CPU priority to ``FOP_BACKGROUND_NICE`` (never raises
    an OSError); only as the first act of a thread that starts none and calls no store."""
    nice = read("FOP_BACKGROUND_NICE")
    if not nice or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError:
        pass


def initializer(*, local_only: bool) -> Callable[[], None] | None:
    """The ``initializer`` of a bulk pool: :func:`lower` when its tasks work on local
    files alone, else None. Reads ``FOP_BACKGROUND_NICE`` now: a bad value fails here."""
    read("FOP_BACKGROUND_NICE")
    return lower if local_only else None
