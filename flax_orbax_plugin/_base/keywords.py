"""The keywords an entry is given, as a whole (one option's value is ``_base.env``'s),
and the declarations as a reader sees them (a signature, docstring lines, the docs' table).

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


def unexpected(owner: str, name: str, names: Iterable[str], hint: str | None = None) -> str:
    """Python's words for an unknown keyword, with the closest name as the hint."""
    if hint is None:
        close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.75)
        hint = f"{close[0]}=" if close else None
    return f"{owner}() got an unexpected keyword argument {name!r}" + (
        f": did you mean {hint}?" if hint else ""
    )


def keywords_taken(fn: Callable) -> frozenset[str] | None:
    """The keywords ``fn`` (under the package's decorators) takes, less ``self``,
    ``cls`` and ``region``; None when it takes ``**kwargs`` (it checks its own)."""
    inner = inspect.unwrap(fn)
    if inner.__code__.co_flags & inspect.CO_VARKEYWORDS:  # not its __signature__, if set
        return None
    params = inspect.signature(inner, follow_wrapped=False).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in kinds) - {"self", "cls", "region"}


def unknown_keywords(owner: str, given: Iterable[str], takes: Iterable[str]) -> TypeError:
    """The TypeError of ``owner`` given keywords it does not take, listing those it takes."""
    takes = set(takes)
    lines = "; ".join(unexpected(owner, k, takes) for k in given if k not in takes)
    return TypeError(f"{lines} (its keywords: {', '.join(sorted(takes))})")


def checked(fn: Callable, owner: str) -> Callable:
    """``fn`` refusing keywords it does not take (itself if it takes ``**kwargs`` or is checked)."""
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
    """TypeError naming each keyword of ``given`` no option of ``declared`` takes, with its likely
    meaning: an alias's option, ``hints[name]``, one of ``inside``'s, else the closest spelling."""
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
    """``obj`` (a public function or class, bound in ``_api``) with "did you mean" for an
    unknown keyword; exceptions and callables taking ``**kwargs`` left as they are."""
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
    """OptionError for ``option`` given (``value`` is not ``default``) in a mode where it
    does nothing, naming ``needs`` (the mode it needs: ``"format_version=2"``)."""
    if value is default or (default is not None and value == default):
        return
    raise OptionError(f"{option}={value!r} does nothing without {needs}")


def with_defaults(declared: Iterable[Option], given: Mapping[str, Any]) -> dict[str, Any]:
    return {o.name: given[o.name] if o.name in given else o.default for o in declared}


def signature(
    leading: Iterable[inspect.Parameter], declared: Iterable[Option]
) -> inspect.Signature:
    """``leading``, then every declared option as a keyword-only parameter."""
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    options = [
        inspect.Parameter(o.name, keyword_only, default=o.default, annotation=o.type_text)
        for o in declared
    ]
    return inspect.Signature([*leading, *options])


def doc_lines(declared: Iterable[Option], *, indent: str = "  ") -> str:
    """One line per declared option, ``name: doc (default: ...)``, for a docstring."""
    return "\n".join(
        f"{indent}{o.name}: {o.doc} (default: {_default_text(o.default)})" for o in declared
    )


def doc_table(declared: Iterable[Option]) -> str:
    """The declared options as a markdown table (docs/manager.md, tested to match)."""
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
