"""Restoring into a changed model: matching a saved tree against ``like``.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.transform``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .._base.tree import flatten
from .._errors import StructureError
from .._format import layout as _layout
from . import casting as _casting
from . import onto_like as _onto_like

__all__ = ["Changes", "changes", "KEEP"]

MISSING_CHOICES = ("error", "keep")
MAX_LISTED = 40  # differences shown in one message; the rest are counted

KEEP = object()  # a leaf of like restored as like's own value

HINT = (
    "If the model changed on purpose: partial=True leaves out saved leaves the model no "
    "longer has, missing='keep' keeps like's own value for leaves the checkpoint lacks, "
    "transform={regex: replacement} (or a callable path -> path or None) maps saved "
    "paths onto like's"
)


@dataclasses.dataclass(frozen=True)
class Changes:
    """The validated options of a restore into a changed model."""

    partial: bool = False
    missing: str = "error"
    transform: Callable[[str], str | None] | None = None

    @property
    def keep_missing(self) -> bool:
        return self.missing == "keep"

    def kwargs(self) -> dict[str, Any]:
        """The options as ``restore`` keywords (``transform`` already compiled)."""
        return {"partial": self.partial, "missing": self.missing, "transform": self.transform}

    def rename(self, path: str) -> str | None:
        return path if self.transform is None else self.transform(path)


def changes(*, partial: Any = False, missing: Any = "error", transform: Any = None) -> Changes:
    """Validates the options (TypeError / ValueError naming the option) and compiles
    ``transform`` once."""
    if not isinstance(partial, bool):
        raise TypeError(f"partial must be True or False, found {partial!r}")
    if missing not in MISSING_CHOICES:
        raise ValueError(f"missing must be one of {MISSING_CHOICES}, found {missing!r}")
    return Changes(partial, missing, compile_transform(transform))


def compile_transform(transform: Any) -> Callable[[str], str | None] | None:
    """``transform`` as one function ``saved path -> like path | None``."""
    if transform is None:
        return None
    if isinstance(transform, Mapping):
        rules = []
        for pattern, replacement in transform.items():
            if not isinstance(pattern, str) or not isinstance(replacement, str):
                raise TypeError(
                    f"transform: expected {{regex: replacement}} of str, found "
                    f"{pattern!r}: {replacement!r}"
                )
            try:
                rules.append((re.compile(pattern), replacement))
            except re.error as e:
                raise ValueError(f"transform: the pattern {pattern!r} is not a regex: {e}") from e

        def by_rules(path: str) -> str:
            for regex, replacement in rules:
                path = regex.sub(replacement, path)
            return path

        return by_rules
    if callable(transform):

        def by_call(path: str) -> str | None:
            out = transform(path)
            if out is not None and not isinstance(out, str):
                raise TypeError(
                    f"transform({path!r}) returned {out!r}; expected a str path or None"
                )
            return out

        by_call.__wrapped__ = transform  # type: ignore[attr-defined]
        return by_call
    raise TypeError(
        f"transform must be a dict {{regex: replacement}} or a callable path -> path | None, "
        f"found {type(transform).__name__}"
    )


def rename_records(records: dict[str, Any], opts: Changes, where: str) -> dict[str, Any]:
    """``{saved path: value}`` keyed by the paths ``opts.transform`` maps them to (a
    saved leaf mapped to None is left out). Two saved leaves onto one path raise."""
    if opts.transform is None:
        return records
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path, value in records.items():
        new = opts.rename(path)
        if new is None:
            continue
        if new in out:
            raise StructureError(
                f"transform maps the saved leaves {origin[new]!r} and {path!r} of {where} "
                f"both to {new!r}"
            )
        out[new], origin[new] = value, path
    return out


def _holds_no_value(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def check_keepable(path: str, leaf: Any) -> None:
    """Raises when ``leaf`` (a leaf of like the checkpoint lacks) has no value to keep."""
    if _holds_no_value(leaf):
        raise StructureError(
            f"leaf {path!r}: not in the checkpoint, and missing='keep' has no value to keep: "
            f"like holds a ShapeDtypeStruct{tuple(leaf.shape)} there; pass a concrete value "
            f"(an initialised model) for that leaf"
        )


def check_item_keepable(name: str, value: Any) -> None:
    """:func:`check_keepable` for every leaf of an item of like the step lacks."""
    flat, _ = flatten(value)
    for path, _, leaf in flat:
        check_keepable(f"{name}/{path}" if path != "<root>" else name, leaf)


def _cast_problem(path: str, record: Any, like: Any) -> str | None:
    """The reason no checked cast takes the saved dtype to like's, whatever the values
    (float to int, to bool, complex to real); None when one may."""
    if record.dtype is None or record.kind == "prng_key" or like is None:
        return None
    try:
        _, want = _onto_like.template_of(path, like)
        if _onto_like.is_key_dtype(want):
            return None
        saved = _layout.dtype_from_name(record.dtype, path=path)
        if saved == want:  # the usual case: nothing to cast
            return None
        _casting.check(path, np.empty((0,), saved), np.dtype(want))
    except StructureError as e:
        return str(e)
    return None


def match(
    flat: list[tuple[str, Any, Any]],
    records: dict[str, tuple[int, Any]],
    opts: Changes,
    *,
    where: str,
    make: Callable[[int, Any, Any], Any],
    empty_kinds: tuple[str, ...] = (),
) -> list[Any]:
    """One entry per leaf of ``flat`` (like's ``(path, keys, leaf)``): ``make(index,
    record, leaf)`` for a leaf the checkpoint holds, :data:`KEEP` for one kept from like.

    ``records``: ``{like path: (index, record)}`` (after :func:`rename_records`).
    Every difference is collected first; then one StructureError lists them all.
    """
    problems: list[str] = []
    casts: list[str] = []  # dtypes no checked cast reaches
    out: list[Any] = []
    wanted = set()
    for path, _, leaf in flat:
        wanted.add(path)
        found = records.get(path)
        if found is None:
            if opts.keep_missing:
                try:
                    check_keepable(path, leaf)
                except StructureError as e:
                    problems.append(str(e))
                out.append(KEEP)
            else:
                problems.append(
                    f"leaf {path!r}: expected by like, found no such key in the checkpoint "
                    f"(missing='keep' keeps like's value)"
                )
                out.append(None)
            continue
        try:
            out.append(make(found[0], found[1], leaf))
        except StructureError as e:
            problems.append(_renamed(str(e), found[1].path, path))
            out.append(None)
            continue
        why = _cast_problem(found[1].path, found[1], leaf)
        if why is not None:
            casts.append(_renamed(why, found[1].path, path))
    if not opts.partial:
        for path, (_, record) in records.items():
            if path not in wanted and record.kind not in empty_kinds:
                problems.append(
                    f"leaf {path!r}: unexpected key: found in the checkpoint but not in like "
                    f"(partial=True leaves it out)"
                )
    if problems:  # casts alone are refused by the read itself, naming a value
        raise mismatch(problems + casts, where)
    return out


def _renamed(message: str, saved: str, path: str) -> str:
    """``message`` about saved leaf ``saved`` naming like's ``path`` too, when a
    transform renamed it."""
    prefix = f"leaf {saved!r}"
    if saved == path or not message.startswith(prefix):
        return message
    return f"leaf {path!r} (saved as {saved!r})" + message[len(prefix) :]


def mismatch(problems: list[str], where: str) -> StructureError:
    """One StructureError listing ``problems`` (the first line names the first one)."""
    shown = problems[:MAX_LISTED]
    more = len(problems) - len(shown)
    noun = "difference" if len(problems) == 1 else "differences"
    lines = [f"{shown[0]}" + (f" ({len(problems) - 1} more below)" if len(problems) > 1 else "")]
    if len(problems) > 1:
        lines.append(f"like does not match the checkpoint at {where}: {len(problems)} {noun}:")
        lines.extend(f"  {p}" for p in shown)
        if more:
            lines.append(f"  ... and {more} more")
    else:
        lines[0] += f" at {where}"
    lines.append(HINT)
    return StructureError("\n".join(lines))
