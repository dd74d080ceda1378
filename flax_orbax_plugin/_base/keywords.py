""" "Did you mean": the public names given their keyword check once, where they are
bound (:func:`named_keywords`, ``_api``), and the check of an entry that takes
``**options`` (:func:`refuse_unknown`), each naming the keyword meant (an alias, a
hint, an option of an inner dict, the closest spelling). The wrapper a call runs
(``env.checked``) and its error's words (``env.unknown_keywords``) are ``_base.env``'s:
every call of a public method passes there.

Pure functions over frozen declarations; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.env``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from .env import Option, checked, unexpected

__all__ = ["named_keywords", "refuse_unknown"]


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
    return checked(obj, obj.__qualname__) if inspect.isfunction(obj) else obj


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
                setattr(cls, name, checked(value, owner))
            elif isinstance(value, (classmethod, staticmethod)):
                setattr(cls, name, type(value)(checked(value.__func__, owner)))


def _alias_of(name: str, declared: Iterable[Option]) -> str | None:
    """``"<option>="`` of the declared option that ``name`` is an alias of, or None."""
    for option in declared:
        if name in option.aliases:
            return option.name + "="
    return None
