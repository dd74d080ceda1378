"""Restoring into a changed model: matching a saved tree against ``like``.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.transform``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._base.shown import outside_stacklevel
from .._base.tree import flatten
from .._errors import NothingMatchedError, StructureError
from .._format import layout as _layout
from . import onto_like as _onto_like
from .onto_like import Changes as Changes
from .onto_like import changes as changes
from .transform_rules import unmatched_rules

logger = logging.getLogger("flax_orbax_plugin")

__all__ = ["Changes", "changes", "KEEP"]

MAX_LISTED = 40  # differences shown in one message; the rest are counted
PATHS_SHOWN = 4  # paths of each side named when nothing matched
NO_DATA = ("none", *_layout.EMPTY_KINDS)  # records that match without holding a value

KEEP = object()  # a leaf of like restored as like's own value

HINT = (
    "If the model changed on purpose: partial=True leaves out saved leaves the model no "
    "longer has, missing='keep' keeps like's own value for leaves the checkpoint lacks, "
    "transform={regex: replacement} (or a callable path -> path or None) maps saved "
    "paths onto like's"
)


def rename_records(records: dict[str, Any], opts: Changes, where: str) -> dict[str, Any]:
    """``{saved path: value}`` keyed by the paths ``opts.transform`` maps them to (a
    saved leaf mapped to None is left out). Two saved leaves onto one path raise."""
    if opts.transform is None:
        return records
    for pattern in unmatched_rules(opts.transform, records):  # a typo, most likely
        warnings.warn(
            f"transform rule {pattern!r} matched no saved leaf path of {where} (they look "
            f"like {next(iter(records), '(none)')!r}): it changed nothing",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
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


def check_keepable(path: str, leaf: Any) -> None:
    """Raises when ``leaf`` (a leaf of like the checkpoint lacks) has no value to keep."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
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


def _cast_problem(path: str, record: Any, like: Any, cast: str) -> str | None:
    """The reason no checked cast takes the saved dtype to like's, whatever the values
    (float to int, to bool, complex to real); None when one may (always, for
    ``cast="unsafe"``)."""
    if record.dtype is None or record.kind == "prng_key" or like is None:
        return None
    try:
        _, want = _onto_like.template_of(path, like)
        if _onto_like.is_key_dtype(want):
            return None
        saved = _layout.dtype_from_name(record.dtype, path=path)
        if saved == want:  # the usual case: nothing to cast
            return None
        _onto_like.check(path, np.empty((0,), saved), np.dtype(want), cast=cast)
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
    saved: list[str],
    cast: str,
    problems: list[str] | None = None,
) -> list[Any]:
    """One entry per leaf of ``flat`` (like's ``(path, keys, leaf)``): ``make(index,
    record, leaf)`` for a leaf the checkpoint holds, :data:`KEEP` for one kept from like.

    ``records``: ``{like path: (index, record)}`` (after :func:`rename_records`);
    ``saved``: the checkpoint's own paths of leaves holding a value (before any
    transform). Every difference is collected first; then one StructureError lists
    them all (after ``problems``, found before: surgery's). A plan that reads none of
    ``saved`` raises NothingMatchedError (see :func:`check_matched`). ``cast``: the
    read's cast policy (a dtype no checked cast reaches is a difference unless
    ``"unsafe"``)."""
    problems = list(problems or ())
    _refuse_one_leaf(flat, records, where)
    casts: list[str] = []  # dtypes no checked cast reaches
    out: list[Any] = []
    for path, _, leaf in flat:
        found = records.get(path)
        if found is None:
            out.append(_missing(path, leaf, records, opts, problems))
            continue
        index, record = found
        try:
            out.append(make(index, record, leaf))
        except StructureError as e:
            problems.append(_renamed(str(e), record.path, path))
            out.append(None)
            continue
        why = _cast_problem(record.path, record, leaf, cast)
        if why is not None:
            casts.append(_renamed(why, record.path, path))
    if not opts.partial:
        wanted = {path for path, _, _ in flat}
        problems += [
            f"leaf {path!r}: unexpected key: found in the checkpoint but not in like "
            f"(partial=True leaves it out)"
            for path, (_, record) in records.items()
            if path not in wanted and record.kind not in empty_kinds
        ]
    if problems:  # casts alone are refused by the read itself, naming a value
        raise mismatch(problems + casts, where)
    if not any(_holds_data(records.get(path)) for path, _, _ in flat):
        like_paths = [
            p for p, _, _ in flat if p not in records or records[p][1].kind not in NO_DATA
        ]
        check_matched(saved, like_paths, sorted(records), opts, where)
    return out


def _refuse_one_leaf(flat: list, records: dict[str, Any], where: str) -> None:
    """like=object(), like=5: no tree at all, while the checkpoint is one."""
    if [p for p, _, _ in flat] == ["<root>"] and "<root>" not in records and records:
        leaf = flat[0][2]
        raise mismatch(
            [
                f"like is one leaf ({type(leaf).__name__} {leaf!r:.60}), not a tree: the "
                f"checkpoint holds {len(records)} leaf(s) ({sorted(records)[:3]}); "
                f"give like the saved structure (fop.metadata(path) lists it), or like=None"
            ],
            where,
        )


def _missing(path: str, leaf: Any, records: dict, opts: Changes, problems: list[str]) -> Any:
    """The entry of like's leaf ``path`` the checkpoint lacks: KEEP (``missing="keep"``)
    or None, a problem appended to ``problems`` (a near miss named on the first one,
    where ``records`` hold the saved paths themselves)."""
    if opts.keep_missing:
        try:
            check_keepable(path, leaf)
        except StructureError as e:
            problems.append(str(e))
        return KEEP
    hint = _onto_like.near_miss(path, records) if not problems and opts.transform is None else ""
    problems.append(
        f"leaf {path!r}: expected by like, found no such key in the checkpoint "
        f"(missing='keep' keeps like's value){hint}"
    )
    return None


def _holds_data(found: tuple[int, Any] | None) -> bool:
    """A saved leaf a read takes a value from (a leaf of like matched)."""
    return found is not None and found[0] >= 0 and found[1].kind not in NO_DATA


def check_matched(
    saved: list[str],
    like_paths: list[str] | None,
    renamed: list[str],
    opts: Changes,
    where: str,
    unit: str = "leaf",
) -> None:
    """Called when a restore reads no saved leaf (or, ``unit="item"``, a manager's
    restore no saved item): raises NothingMatchedError when the checkpoint at ``where``
    holds values (``saved``), since every leaf would come back as like's own; with
    ``missing="keep_all"`` (nothing may match, on purpose) it logs a WARNING instead.
    ``like_paths``: like's leaves (None: no like); ``renamed``: the saved paths as the
    transform maps them."""
    if not saved:
        return  # an empty checkpoint: nothing to match
    what = f"restore of {where} matched no saved {unit} ({opts.describe()})"
    if opts.nothing_may_match:
        logger.warning(
            "checkpoint: %s; missing='keep_all' accepts it: every leaf of like keeps its "
            "own value and nothing is read",
            what,
        )
        return
    units = "leaves" if unit == "leaf" else f"{unit}s"
    sides = [f"The checkpoint's {units}: {_some(saved)}"]
    if opts.transform is not None and unit == "leaf":
        sides.append(f"after transform: {_some(renamed)}")
    if like_paths is not None:
        sides.append(f"like's {units}: {_some(like_paths)}")
    result = "nothing" if like_paths is None else "like itself, untouched"
    raise NothingMatchedError(
        f"{what}: it would return {result}. " + "; ".join(sides) + ". Make like's paths "
        "(or transform=) meet the saved ones (fop.metadata lists them); to accept a "
        "restore that matches nothing on purpose, pass missing='keep_all'"
    )


def _some(paths: list[str]) -> str:
    if not paths:
        return "none"
    shown = ", ".join(repr(p) for p in paths[:PATHS_SHOWN])
    more = len(paths) - PATHS_SHOWN
    return shown + (f" ... ({len(paths)} in all)" if more > 0 else "")


def _renamed(message: str, saved: str, path: str) -> str:
    """``message`` about saved leaf ``saved`` naming like's ``path`` too, when a
    transform renamed it."""
    prefix = f"leaf {saved!r}"
    if saved == path or not message.startswith(prefix):
        return message
    return f"leaf {path!r} (saved as {saved!r})" + message[len(prefix) :]


def mismatch(problems: list[str], where: str) -> StructureError:
    """One StructureError listing ``problems`` (the first line names the first one)."""
    if len(problems) == 1:
        return StructureError(f"{problems[0]} at {where}\n{HINT}")
    lines = [
        f"{problems[0]} ({len(problems) - 1} more below)",
        f"like does not match the checkpoint at {where}: {len(problems)} differences:",
        *(f"  {p}" for p in problems[:MAX_LISTED]),
    ]
    if len(problems) > MAX_LISTED:
        lines.append(f"  ... and {len(problems) - MAX_LISTED} more")
    return StructureError("\n".join([*lines, HINT]))
