"""The ``transform=`` option of a restore, checked and compiled once where it enters.

``compile_transform`` runs before anything is read. Pure functions; safe from any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.transform_rules``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import TransformError

__all__ = ["compile_transform", "describe", "template_fault", "unmatched_rules"]

EXPECTED = "a dict {regex: replacement} of str, or a callable path -> path | None"
SOURCE = "_fop_transform_source"  # the option as given, on the compiled function
RULES = "_fop_transform_rules"  # a dict option's compiled rules, in order


def compile_transform(transform: Any) -> Callable[[str], str | None] | None:
    """``transform`` as one function ``saved path -> like path | None`` (None: none; one
    this returned: as is); TransformError for a malformed option."""
    if transform is None:
        return None
    if callable(transform) and hasattr(transform, SOURCE):
        return transform
    if isinstance(transform, Mapping):
        rules = [_rule(pattern, replacement) for pattern, replacement in transform.items()]
        compiled = _by_rules(rules)
        setattr(compiled, RULES, rules)
    elif callable(transform):
        compiled = _by_call(transform)
    else:
        raise TransformError(
            f"transform: expected {EXPECTED}, found {type(transform).__name__} {_short(transform)}"
        )
    setattr(compiled, SOURCE, transform)
    return compiled


def unmatched_rules(compiled: Callable[[str], str | None] | None, paths: Any) -> list[str]:
    """The patterns of a ``{regex: replacement}`` transform no saved path matched (the
    rules applied in order, as the restore does); [] for a callable or None."""
    rules = getattr(compiled, RULES, None)
    if not rules:
        return []
    hit = [False] * len(rules)
    for path in paths:
        for i, (regex, replacement) in enumerate(rules):
            path, count = regex.subn(replacement, path)
            hit[i] = hit[i] or count > 0
        if all(hit):
            return []
    return [regex.pattern for (regex, _), matched in zip(rules, hit, strict=True) if not matched]


def describe(compiled: Callable[[str], str | None] | None) -> str:
    """The option as given, for messages: ``transform={...}``."""
    if compiled is None:
        return "transform=None"
    source = getattr(compiled, SOURCE, compiled)
    if isinstance(source, Mapping):
        return f"transform={_short(dict(source))}"
    return f"transform={getattr(source, '__qualname__', type(source).__name__)}"


def _rule(pattern: Any, replacement: Any) -> tuple[re.Pattern, str]:
    if not isinstance(pattern, str):
        raise TransformError(
            f"transform: every key is a regex pattern (a str); found "
            f"{type(pattern).__name__} {_short(pattern)}"
        )
    entry = f"transform[{pattern!r}]"
    if not isinstance(replacement, str):
        raise TransformError(
            f"{entry}: expected a replacement str (an re.sub template such as "
            f"r'block\\1'), found {type(replacement).__name__} {_short(replacement)}"
        )
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise TransformError(f"{entry}: the pattern is not a regex: {e}") from None
    if (fault := template_fault(regex, replacement)) is not None:
        raise TransformError(f"{entry}: {fault}")
    return regex, replacement


def template_fault(regex: re.Pattern, replacement: str) -> str | None:
    """Why ``replacement`` is no ``re`` template for ``regex``, or None: expanded against
    a match of ``regex``'s (empty) groups, as ``re.sub`` would; every rule option's check."""
    names = {index: name for name, index in regex.groupindex.items()}
    groups = "".join(
        f"(?P<{names[i]}>)" if i in names else "()" for i in range(1, regex.groups + 1)
    )
    try:
        re.compile(groups).fullmatch("").expand(replacement)
    except (re.error, IndexError) as e:
        return (
            f"the replacement {replacement!r} is not a valid template for its "
            f"pattern ({e}); the pattern has {_groups(regex)}. Expected references to "
            f"those groups only (\\1, \\g<1>, \\g<name>), and \\\\ for a backslash"
        )
    return None


def _groups(regex: re.Pattern) -> str:
    if regex.groups == 0:
        return "no groups"
    noun = "group" if regex.groups == 1 else "groups"
    numbered = ", ".join(f"\\{i}" for i in range(1, regex.groups + 1))
    named = ", ".join(repr(n) for n in regex.groupindex)
    return f"{regex.groups} {noun} ({numbered})" + (f", named {named}" if named else "")


def _by_rules(rules: list[tuple[re.Pattern, str]]) -> Callable[[str], str]:
    def by_rules(path: str) -> str:
        for regex, replacement in rules:
            path = regex.sub(replacement, path)
        return path

    return by_rules


def _by_call(transform: Callable[[str], Any]) -> Callable[[str], str | None]:
    def by_call(path: str) -> str | None:
        try:
            out = transform(path)
        except TransformError:
            raise
        except Exception as e:  # the caller's code: named, its error chained
            raise TransformError(
                f"transform({path!r}) raised {type(e).__name__}: {e}; expected a str path "
                f"or None for every saved leaf path"
            ) from e
        if out is not None and not isinstance(out, str):
            raise TransformError(
                f"transform({path!r}) returned {type(out).__name__} {_short(out)}; "
                f"expected a str path or None"
            )
        return out

    return by_call


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
