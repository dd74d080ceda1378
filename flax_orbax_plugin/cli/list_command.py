"""``flax-orbax list``: the steps of a run directory (a table, ``--json`` or ``--plot``),
or what a step, an item or a core checkpoint is.
"""

from __future__ import annotations

from math import isfinite
from typing import Any

from .._errors import CheckpointError
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import COMMIT_FILE, MANIFEST_FILE
from .._storage.location import Location
from . import display
from .display import make_table
from .output import CliError, emit, human_bytes, iso_time, one_line, shell_word
from .paths import describe_missing, dir_bytes, load_extras


def cmd_list(args) -> int:
    loc = Location.from_path(args.directory)
    if args.plot:
        display.check_output(args.plot)
    if args.json or args.plot:
        return _list_data(loc, args)
    if _list_one_checkpoint(loc):
        return 0
    listing = _steps.list_directory(loc)
    if not loc.is_dir() or _steps.foreign_format_hint(loc):
        raise CliError(describe_missing(loc, listing))
    if not listing.committed and not listing.unreadable:
        print(describe_missing(loc, listing))
    else:
        shut = dict(listing.unreadable)  # step folders the environment kept shut: a row each
        steps = sorted({*listing.committed, *shut})
        print(f"{loc}: {len(steps)} step(s)")
        rows = [_list_row(_step_record(loc, step, shut=shut.get(step))) for step in steps]
        print(make_table(rows))
    if listing.unfinished:
        print(
            f"unfinished (not steps; `flax-orbax gc` removes those of dead saves that prove "
            f"themselves this library's): {', '.join(listing.unfinished)}"
        )
    if listing.corrupt:
        print(f"set aside as damaged (kept): {', '.join(listing.corrupt)}")
    if listing.foreign:
        print(f"not steps of this library (left alone): {', '.join(listing.foreign)}")
    return 0


def _list_one_checkpoint(loc: Location) -> bool:
    """``list`` of a step, an item or a core checkpoint: what it is; False otherwise."""
    if loc.exists(MANIFEST_FILE):
        manifest = _layout.read_manifest(loc)
        print(f"{loc}: step {manifest.step} of the run directory {loc.parent}")
        print(make_table([_list_row(_step_record(loc.parent, manifest.step, step_loc=loc))]))
        kinds = ", ".join(f"{n} ({e.kind})" for n, e in sorted(manifest.items.items()))
        print(f"items: {kinds}")
        return True
    if (item := _steps.step_item(loc)) is not None:
        what = "its leaves" if item.is_pytree else "its value"
        print(f"{loc}: {item.label} of the run directory {loc.parent.parent}")
    elif loc.exists(COMMIT_FILE):
        what = "its leaves"
        print(f"{loc}: a checkpoint of one pytree (fop.save), not a directory of steps")
    else:
        return False
    word = shell_word(loc)
    print(f"`flax-orbax inspect {word}` shows {what}, `flax-orbax verify {word}` checks it")
    return True


def _list_data(loc: Location, args) -> int:
    """``list --json`` / ``--plot`` of a run, or of one step (as a run of one)."""
    if loc.exists(MANIFEST_FILE):
        directory, steps = loc.parent, [_layout.read_manifest(loc).step]
        listing = _steps.Listing(committed=tuple(steps), unfinished=(), corrupt=(), foreign=())
        records = [_step_record(directory, steps[0], step_loc=loc)]
    else:
        listing = _steps.list_directory(loc)
        shut = dict(listing.unreadable)  # step folders the environment kept shut
        if not (listing.committed or shut) and (
            not loc.is_dir() or _steps.foreign_format_hint(loc)
        ):
            raise CliError(describe_missing(loc, listing))
        if _steps.step_item(loc) is not None or loc.exists(COMMIT_FILE):
            raise CliError(
                f"{loc}: not a directory of steps; `flax-orbax inspect {shell_word(loc)}`"
            )
        directory = loc
        steps = sorted({*listing.committed, *shut})
        records = [_step_record(loc, step, shut=shut.get(step)) for step in steps]
    if args.plot:
        saves = [
            display.Save(r["step"], r["_time"], r["bytes_written"], r["bytes_reused"])
            for r in records
            if r["_time"] is not None
        ]
        display.saves_figure(str(directory), saves, args.plot)
    if args.json:
        emit(
            {
                "directory": str(directory),
                "steps": [{k: v for k, v in r.items() if k[0] != "_"} for r in records],
                "unfinished": list(listing.unfinished),
                "set_aside": list(listing.corrupt),
                "foreign": list(listing.foreign),
            }
        )
    else:
        print(f"wrote {args.plot} ({len(records)} step(s) of {directory})")
    return 0


def _step_record(
    loc: Location, step: int, *, step_loc: Location | None = None, shut: str | None = None
) -> dict:
    """One step of ``list``: the fields of ``list --json``, and ``_time`` (for a plot),
    ``_metrics`` (every numeric extra), ``_damage`` (whether ``damaged`` is damage)."""
    step_loc = step_loc or _steps.step_location(loc, step)
    out: dict[str, Any] = {"step": step, "_time": None, "size_bytes": None}
    try:
        if shut is not None:
            raise PermissionError(shut)
        out["size_bytes"] = dir_bytes(step_loc)
        manifest, extras = _layout.read_manifest(step_loc), load_extras(step_loc)
    except (CheckpointError, OSError) as e:  # OSError: unreadable here (not checked)
        out.update(bytes_written=None, bytes_reused=None, saved_at=None, items=[], metrics={})
        return {**out, "damaged": _why(e), "_damage": isinstance(e, CheckpointError)}
    numbers = {
        k: v for k, v in extras.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return {
        **out,
        "bytes_written": manifest.bytes_written,
        "bytes_reused": manifest.bytes_reused,
        "saved_at": iso_time(manifest.time),
        "_time": manifest.time,
        "items": sorted(manifest.items),
        "metrics": {k: v for k, v in numbers.items() if not isinstance(v, float) or isfinite(v)},
        "_metrics": numbers,
        "damaged": None,
    }


def _why(e: BaseException) -> str:
    text = one_line(e)
    if isinstance(e, CheckpointError) or text.startswith("cannot be read"):
        return text
    return f"cannot be read: {text}"


def _list_row(record: dict) -> dict[str, str]:
    """One row of the ``list`` table from :func:`_step_record`'s ``record``."""
    step = str(record["step"])
    if record["damaged"] is not None:
        what = "DAMAGED: " if record["_damage"] else ""
        cells = ("?", "?", "?", "?", what + record["damaged"], "-")
        return dict(zip(_COLUMNS, (step, *cells), strict=True))
    size, written, reused = record["size_bytes"], record["bytes_written"], record["bytes_reused"]
    metrics = sorted(record["_metrics"].items())
    return dict(
        step=step,
        size="?" if size is None else human_bytes(size),
        written="-" if written is None else human_bytes(written),
        reused="-" if reused is None else human_bytes(reused),
        saved=record["saved_at"],
        items=",".join(record["items"]),
        metrics=" ".join(f"{k}={_metric(v)}" for k, v in metrics) or "-",
    )


_COLUMNS = ("step", "size", "written", "reused", "saved", "items", "metrics")


def _metric(value: int | float) -> str:
    """A metric in 4 significant digits (an int past a float's range too)."""
    try:
        return f"{value:.4g}"
    except OverflowError:
        digits, sign = str(abs(value)), "-" if value < 0 else ""
        return f"{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"
