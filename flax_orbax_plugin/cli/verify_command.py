"""``flax-orbax verify``: every checksum; ``--all`` of a run checks a step at a time."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from .._core.verify import verify
from .._errors import CheckpointError, CheckpointNotFoundError, OptionError
from .._format import steps as _steps
from .._storage.location import Location
from .display import byte_progress
from .output import EXIT_DAMAGED, EXIT_ERROR, CliError, emit, one_line


def cmd_verify(args) -> int:
    loc = Location.from_path(args.path)
    unreadable: list[dict[str, Any]] = []  # steps an environment error kept shut
    try:
        steps, shut = _run_steps(loc, args)
        if steps:
            results, unreadable = _verify_each_step(loc, steps, shut, args.memory_limit)
        else:
            results = verify(
                args.path,
                step=args.step,
                all_steps=args.all,
                progress=byte_progress("verify"),
                memory_limit_bytes=args.memory_limit,
            )
    except OptionError as e:  # options that conflict (or with PATH): a usage error
        raise CliError(one_line(e)) from e
    except CheckpointError as e:
        # Nothing checkable at PATH: a usage error, unless something is there but broken.
        if loc.is_dir() and not isinstance(e, CheckpointNotFoundError):
            if args.json:
                result = {"path": str(loc), "step": None, "item": None, "ok": False}
                _verify_json(str(loc), [{**result, "error": one_line(e)}])
            else:
                print(f"DAMAGED  {loc}: {one_line(e)}")
            return EXIT_DAMAGED
        raise CliError(one_line(e)) from None
    damaged = [r for r in results if not r.ok]
    failed = EXIT_DAMAGED if damaged else EXIT_ERROR if unreadable else 0
    if args.json:
        found = [dataclasses.asdict(r) for r in results] + unreadable
        _verify_json(str(loc), found, unreadable=len(unreadable))
        return failed
    for u in unreadable:
        print(f"UNREADABLE step {u['step']}: {u['error']}")
    if unreadable:
        steps = ", ".join(str(u["step"]) for u in unreadable)
        print(f"verify: {len(unreadable)} step(s) could not be read: {steps}", file=sys.stderr)
    for r in results:
        label = _name(r, "step ")
        if r.ok:
            print(f"ok       {label}" + (f" ({r.note})" if r.note else ""))
        else:
            print(f"DAMAGED  {label}: {one_line(r.error or '')}")
    if damaged:
        names = ", ".join(_name(r) for r in damaged)
        print(f"verify: {len(damaged)} damaged: {names}", file=sys.stderr)
        return EXIT_DAMAGED
    if not unreadable:
        print(f"verify: all {len(results)} checkpointable(s) ok")
    return failed


def _name(r: Any, step: str = "") -> str:
    """A result's path, or its step (after ``step``) and item (when it has one)."""
    return r.path if r.step is None else f"{step}{r.step}" + (f"/{r.item}" if r.item else "")


def _run_steps(loc: Location, args) -> tuple[list[int], dict[int, str]]:
    """The steps of run ``loc`` to verify one at a time, and why each unreadable one was
    shut; none for anything else (``fop.verify`` of PATH)."""
    if args.step is not None:
        return [], {}
    try:
        listing = _steps.list_directory(loc)
    except (CheckpointError, OSError):  # nothing to list: fop.verify says what PATH is
        return [], {}
    shut = dict(listing.unreadable)
    steps = sorted({*listing.committed, *shut})
    if not steps or not (args.all or listing.committed):
        return [], {}
    return (steps if args.all else steps[-1:]), shut


def _verify_each_step(
    loc: Location, steps: list[int], shut: dict[int, str], limit: int | None
) -> tuple[list, list[dict[str, Any]]]:
    """``verify`` of each step by its own path; one that cannot be read is reported, not damage."""
    results, unreadable = [], []
    for step in steps:
        where = str(_steps.step_location(loc, step))
        try:
            if step in shut:
                raise PermissionError(shut[step])
            progress = byte_progress("verify")
            results.extend(verify(where, progress=progress, memory_limit_bytes=limit))
        except OSError as e:
            if isinstance(e, CheckpointError):  # (CheckpointNotFoundError): not shut
                raise
            error = one_line(e) if step in shut else f"cannot be read: {one_line(e)}"
            unreadable.append(
                {"path": where, "step": step, "item": None, "ok": False, "error": error}
            )
    return results, unreadable


def _verify_json(path: str, results: list[dict[str, Any]], *, unreadable: int = 0) -> None:
    bad = sum(not r["ok"] for r in results)
    doc = {"path": path, "ok": not bad, "damaged": bad - unreadable, "results": results}
    if unreadable:  # steps that could not be read (an environment error, not damage)
        doc["unreadable"] = unreadable
    emit(doc)
