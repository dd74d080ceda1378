"""Options declared once: each public option's type, range and allowed values.

An :class:`Option` is one keyword option (or ``FOP_*`` environment variable) as
declared by the module that owns it (``_core.requests`` for the core's entry points,
``_manager.option_table`` for the manager and the callback, ``_manager.policy``,
``_manager.retention`` and ``_manager.tiers.tier_option`` for the fields of the public
option objects): its name, kind, range or choices, default, one-line doc and the
names other libraries give it. :func:`check` checks the values given by name against
their declarations, where they enter, and raises
:class:`~flax_orbax_plugin.OptionError` (a ValueError) or
:class:`~flax_orbax_plugin.OptionTypeError` (also a TypeError) naming the option,
what it takes and what was found, with the closest allowed string where one is close.
:func:`refuse_without` refuses an option that does nothing in the chosen mode;
:func:`refuse_unknown` a keyword that is no option ("did you mean"; for the public
functions and classes that take no ``**options``, :func:`named_keywords`), and
:func:`signature`, :func:`doc_lines` and :func:`doc_table` derive what ``help()`` and
the docs show from the same declarations.

Pure functions over frozen records; any thread.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import math
import numbers
import operator
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import CheckpointError, OptionError, OptionTypeError

__all__ = [
    "INT64_MAX",
    "Option",
    "check",
    "doc_lines",
    "doc_table",
    "flag",
    "found",
    "named_keywords",
    "outside_stacklevel",
    "refuse_unknown",
    "refuse_without",
    "signature",
    "with_defaults",
]

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
    words of the messages (derived from the declaration when empty). ``default``: the
    value when it is not given; ``doc``: one line for the docstring and docs tables;
    ``aliases``: names other libraries (or earlier versions) give this option, which
    an unknown keyword of that name is pointed to; ``annotation``: the type shown in
    the signature (derived from ``kind`` when empty)."""

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
        if low is not None and (value <= low if self.low_open else value < low):
            self._fail(value, wrong_type=False)
        if high is not None and value > high:
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
    """A numpy bool or integer scalar as Python's (numpy is not imported: the CLI's
    start loads none); anything else as it is."""
    numpy = type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0
    if numpy and getattr(value.dtype, "kind", None) in ("b", "i", "u"):
        return value.item()
    return value


_PLAIN = {"int": operator.index, "number": float, "flag": bool, "choice": _plain}
_ANNOTATIONS = {
    "int": "int",
    "number": "float",
    "flag": "bool",
    "str": "str",
    "callable": "Callable",
}


def check(declared: Iterable[Option], values: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of ``declared`` present in ``values`` checked, by its name:
    ``{name: checked value}``; the first bad one raises OptionError naming it."""
    out = {}
    for option in declared:
        if option.name in values:
            out[option.name] = option.check(values[option.name])
    return out


def flag(name: str, value: Any) -> bool:
    """``value`` of the flag ``name`` as a bool; 1, "no" or None: OptionTypeError."""
    return Option(name, "flag").check(value)


def refuse_without(option: str, value: Any, needs: str, *, default: Any = None) -> None:
    """Refuses ``option`` given (``value`` is not ``default``) in a mode where it does
    nothing: OptionError naming the option, its value and ``needs`` (the mode it needs,
    as the message says it: ``"format_version=2"``)."""
    if value is default or (default is not None and value == default):
        return
    raise OptionError(f"{option}={value!r} does nothing without {needs}")


def with_defaults(declared: Iterable[Option], given: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: value}`` of every declared option: ``given``'s, else its default."""
    return {o.name: given[o.name] if o.name in given else o.default for o in declared}


def refuse_unknown(
    owner: str,
    given: Iterable[str],
    declared: Iterable[Option],
    *,
    hints: Mapping[str, str] | None = None,
    inside: tuple[str, Iterable[Option]] | None = None,
) -> None:
    """Raises TypeError naming each keyword of ``given`` that no option of ``declared``
    takes, with what it most likely stands for: an option whose ``aliases`` name it,
    ``hints[name]`` (words for names that are no single option), an option of the
    dict option ``inside = (option, declared)`` takes (the callback's
    ``manager_options``), then the closest spelling; the message lists the options."""
    declared = tuple(declared)
    names = {o.name for o in declared}
    unknown = [name for name in given if name not in names]
    if not unknown:
        return
    inner_option, inner = inside if inside is not None else ("", ())
    inner_names = {o.name for o in inner}
    lines = []
    for name in unknown:
        hint = _alias_of(name, declared) or (hints or {}).get(name)
        alias = _alias_of(name, inner)
        inner_name = alias[:-1] if alias else (name if name in inner_names else None)
        if inner_name is not None and hint is None:
            hint = f"{inner_option}={{{inner_name!r}: ...}}"
        lines.append(_unexpected(owner, name, names, hint))
    raise TypeError("; ".join(lines) + f" (its options: {', '.join(sorted(names))})")


def _unexpected(owner: str, name: str, names: Iterable[str], hint: str | None = None) -> str:
    """Python's words for an unknown keyword, with the closest name as the hint."""
    if hint is None:
        close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.75)
        hint = f"{close[0]}=" if close else None
    return f"{owner}() got an unexpected keyword argument {name!r}" + (
        f": did you mean {hint}?" if hint else ""
    )


def named_keywords(obj: Any, *, methods: bool = False) -> Any:
    """``obj`` (a public function or class) with "did you mean" for an unknown keyword
    (refused in the region of a collective call): a function is returned wrapped (its
    module's own name stays unwrapped, for the package's calls); a class gets its
    ``__init__`` wrapped, and with ``methods`` its public methods (its own and those of
    the package's classes it inherits), set on the class itself. A callable taking
    ``**kwargs`` checks its own (:func:`refuse_unknown`) and is left as it is, as are
    exceptions. Applied once, where the public names are bound (``_api``)."""
    if isinstance(obj, type):
        if not issubclass(obj, BaseException):
            _name_methods(obj, methods)
        return obj
    return _checked(obj, obj.__qualname__) if inspect.isfunction(obj) else obj


def _name_methods(cls: type, methods: bool) -> None:
    package = __name__.split(".")[0]
    done = set()
    for base in cls.__mro__:
        if not base.__module__.startswith(package):
            continue
        for name, value in vars(base).items():
            if name in done or (name != "__init__" and (not methods or name.startswith("_"))):
                continue
            done.add(name)
            owner = cls.__name__ if name == "__init__" else f"{cls.__name__}.{name}"
            if inspect.isfunction(value):
                setattr(cls, name, _checked(value, owner))
            elif isinstance(value, (classmethod, staticmethod)):
                setattr(cls, name, type(value)(_checked(value.__func__, owner)))


def keywords_taken(fn: Callable) -> frozenset[str] | None:
    """The keywords ``fn`` (under the package's decorators) takes, those the package
    hands it (``self``, ``cls``, ``region``) left out; None when it takes ``**kwargs``
    (it checks its own: :func:`refuse_unknown`)."""
    inner = inspect.unwrap(fn)  # under the package's decorators (store errors, regions)
    if inner.__code__.co_flags & inspect.CO_VARKEYWORDS:  # not its __signature__, if set
        return None
    params = inspect.signature(inner, follow_wrapped=False).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in kinds) - {"self", "cls", "region"}


def unknown_keywords(owner: str, given: Iterable[str], takes: Iterable[str]) -> TypeError:
    """The TypeError of a call of ``owner`` given keywords it does not take (each named,
    with the one meant: "did you mean ...?"; then every keyword it takes)."""
    takes = set(takes)
    lines = "; ".join(_unexpected(owner, k, takes) for k in given if k not in takes)
    return TypeError(f"{lines} (its keywords: {', '.join(sorted(takes))})")


def _checked(fn: Callable, owner: str) -> Callable:
    if getattr(fn, "_fop_named", False):
        return fn
    takes = keywords_taken(fn)
    if takes is None:
        return fn
    region = getattr(fn, "_fop_region", lambda *a, **k: contextlib.nullcontext())

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if takes.issuperset(kwargs):
            return fn(*args, **kwargs)
        with region(*args, **kwargs):
            raise unknown_keywords(owner, kwargs, takes)

    call._fop_named = True  # type: ignore[attr-defined]
    return call


def _alias_of(name: str, declared: Iterable[Option]) -> str | None:
    """``"<option>="`` of the declared option that ``name`` is an alias of, or None."""
    for option in declared:
        if name in option.aliases:
            return option.name + "="
    return None


def signature(
    leading: Iterable[inspect.Parameter], declared: Iterable[Option]
) -> inspect.Signature:
    """``leading`` (``self``, ``directory``...) then every declared option as a
    keyword-only parameter with its default and type: what ``help()`` and
    ``inspect.signature`` show for a function that takes ``**options``."""
    options = [
        inspect.Parameter(
            o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.type_text
        )
        for o in declared
    ]
    return inspect.Signature([*leading, *options])


def doc_lines(declared: Iterable[Option], *, indent: str = "  ") -> str:
    """One line per declared option, ``name: doc (default: ...)``, for a docstring."""
    return "\n".join(
        f"{indent}{o.name}: {o.doc} (default: {_default_text(o.default)})" for o in declared
    )


def doc_table(declared: Iterable[Option]) -> str:
    """The declared options as a markdown table (docs/manager.md holds these, tested
    to match): option, type, default, doc."""
    rows = ["| option | type | default | what it does |", "|---|---|---|---|"]
    for o in declared:
        kind = o.type_text.replace("|", "\\|")
        rows.append(f"| `{o.name}` | `{kind}` | `{_default_text(o.default)}` | {o.doc} |")
    return "\n".join(rows)


def _default_text(value: Any) -> str:
    name = getattr(value, "__qualname__", None)
    if callable(value) and name is not None:
        return f"{getattr(value, '__module__', '')}.{name}".lstrip(".")
    return repr(value)


def outside_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` called from inside the package
    name the first frame outside it (the user's call; the frames of ``contextlib``,
    which the package's collective decorators run in, are skipped too)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and _inside(frame.f_code.co_filename, package):
        frame, level = frame.f_back, level + 1
    return level


def _inside(filename: str, package: str) -> bool:
    return os.path.abspath(filename).startswith(package) or filename == contextlib.__file__
