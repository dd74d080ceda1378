"""The keywords an entry is given, as a whole (one option's value is ``_base.env``'s):
"did you mean" for one it does not take, bound once to the public names
(:func:`named_keywords`, ``_api``) or checked by an entry that takes ``**options``
(:func:`refuse_unknown`), each naming the keyword meant (an alias, a hint, an option of
an inner dict, the closest spelling); an option given in a mode where it does nothing
(:func:`refuse_without`); the declared defaults of those not given
(:func:`with_defaults`); the wrapper a call of a public function or constructor runs
(:func:`checked`, bound by :func:`named_keywords`) and its error's words
(:func:`unknown_keywords`, also ``_base.distributed.public``'s). A call with the keywords
its entry takes passes the wrapper's one set test and nothing else here.

Pure functions over frozen declarations; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.env``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._errors import OptionError
from .env import Option

__all__ = [
    "checked",
    "keywords_taken",
    "named_keywords",
    "refuse_unknown",
    "refuse_without",
    "unexpected",
    "unknown_keywords",
    "with_defaults",
]


def unexpected(owner: str, name: str, names: Iterable[str], hint: str | None = None) -> str:
    """Python's words for an unknown keyword, with the closest name as the hint."""
    if hint is None:
        close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.75)
        hint = f"{close[0]}=" if close else None
    return f"{owner}() got an unexpected keyword argument {name!r}" + (
        f": did you mean {hint}?" if hint else ""
    )


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
    lines = "; ".join(unexpected(owner, k, takes) for k in given if k not in takes)
    return TypeError(f"{lines} (its keywords: {', '.join(sorted(takes))})")


def checked(fn: Callable, owner: str) -> Callable:
    """``fn`` (a function or constructor of one process: no region) refusing a keyword
    it does not take with :func:`unknown_keywords` (``owner``: its name there); ``fn``
    itself where it takes ``**kwargs`` or checks its own (``_base.distributed.public``)."""
    if getattr(fn, "_fop_named", False):
        return fn
    takes = keywords_taken(fn)
    if takes is None:
        return fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not takes.issuperset(kwargs):
            raise unknown_keywords(owner, kwargs, takes)
        return fn(*args, **kwargs)

    call._fop_named = True  # type: ignore[attr-defined]
    return call


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
        lines.append(unexpected(owner, name, names, hint))
    raise TypeError("; ".join(lines) + f" (its options: {', '.join(sorted(names))})")


def named_keywords(obj: Any) -> Any:
    """``obj`` (a public function or a plain class: an option object, a rule, a surgery
    op) with "did you mean" for an unknown keyword: a function is returned wrapped (its
    module's own name stays unwrapped, for the package's calls); a class gets its
    ``__init__`` (its own or one of the package's classes it inherits) wrapped, set on
    the class itself. A callable taking ``**kwargs`` checks its own
    (:func:`refuse_unknown`) and is left as it is, as are exceptions and an entry of
    ``_base.distributed.public`` (a function, or the ``__init__`` and methods of a
    class it decorates: the manager, the callback), which checks its own keywords.
    Applied once, where the public names are bound (``_api``)."""
    if isinstance(obj, type):
        if not issubclass(obj, BaseException):
            _name_init(obj)
        return obj
    return checked(obj, obj.__qualname__) if inspect.isfunction(obj) else obj


def _name_init(cls: type) -> None:
    package = __name__.split(".")[0]
    for base in cls.__mro__:
        if base.__module__.startswith(package) and "__init__" in vars(base):
            init = vars(base)["__init__"]
            if inspect.isfunction(init):
                cls.__init__ = checked(init, cls.__name__)  # type: ignore[misc]
            return


def _alias_of(name: str, declared: Iterable[Option]) -> str | None:
    """``"<option>="`` of the declared option that ``name`` is an alias of, or None."""
    for option in declared:
        if name in option.aliases:
            return option.name + "="
    return None


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
