"""``inspect``, ``export``, ``import`` and ``gc``: ``cmd_<name>(args) -> exit status``,
called by ``dispatch`` after ``main`` checked the usage; a client of the library, so on
every store the library takes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any

from .._core import ownership as _ownership
from .._core import restore as _restore
from .._core import writer_liveness as _liveness
from .._errors import (
    CheckpointError,
    DirectoryLockedError,
    ForeignEntryError,
    OptionError,
    StructureError,
)
from .._format import foreign as _foreign
from .._format import steps as _steps
from .._interop import safetensors as _safetensors
from .._interop.importing import import_checkpoint
from .._interop.safetensors import plan as _safetensors_plan
from .._interop.safetensors import remains as _remains
from .._interop.safetensors.headers import DTYPE_NAMES as _SAFETENSORS_DTYPES
from .._interop.safetensors.headers import read_safetensors_index, tensor_nbytes
from .._like.onto_like import with_advice
from .._manager.checkpointables import COPY_KINDS
from .._manager.housekeeping import rolls_forward
from .._manager.manager import CheckpointManager
from .._manager.retention import Retention, sound_steps_to_delete
from .._storage import lease as _lease
from .._storage.location import Location
from .._storage.lock import live_holder
from . import display
from .display import byte_progress, make_table, status
from .output import CliError, emit, human_bytes, one_line, shell_word
from .paths import JSON_KINDS, names_one, read_json_item, resolve


def _sharding_str(sharding: Any) -> str:
    if not sharding:
        return "-"
    if sharding.get("type") == "NamedSharding":
        axes = dict(zip(sharding["mesh_axis_names"], sharding["mesh_shape"], strict=False))
        spec = ",".join("None" if s is None else str(s) for s in sharding["spec"])
        return f"P({spec}) mesh{axes}"
    if sharding.get("type") == "SingleDeviceSharding":
        return "single device"
    return sharding.get("type", "?")


def cmd_inspect(args) -> int:
    if args.plot:
        display.check_output(args.plot)
    label, items = resolve(args.path, args.step, args.item)
    described = [_describe_item(item) for item in items]
    grand_total = sum(d.get("total_bytes", 0) for d in described)
    if args.plot:
        bars = [
            display.Bar(f"{d['name']}/{leaf['path']}", d["name"], leaf["bytes"])
            for d in described
            for leaf in d.get("leaves", ())
        ]
        display.leaves_figure(label, bars, args.plot)
    if args.json:
        emit({"path": label, "items": described, "total_bytes": grand_total})
        return 0
    if args.plot and not args.summary:
        print(f"wrote {args.plot} ({label}: {human_bytes(grand_total)} of arrays)")
        return 0
    print(label)
    for d in described:
        _print_item(d, summary=args.summary)
    print(f"\nAll arrays: {grand_total:,} bytes ({human_bytes(grand_total)})")
    return 0


def _describe_item(item) -> dict[str, Any]:
    """One item of ``inspect --json`` (an ``fop.HFShards`` item's from its headers)."""
    described = {"name": item.name, "kind": item.kind}
    if item.kind in JSON_KINDS:
        return {**described, "value": read_json_item(item)}
    if item.kind in COPY_KINDS and not item.loc.is_local:
        note = "Hugging Face shards on an object store: copy the folder down to list them"
        return {**described, "note": note}
    if item.kind in COPY_KINDS:
        stored = sorted(read_safetensors_index(item.loc.path).items())
        leaves = [
            _leaf(name, t.shape, str(t.dtype), None, tensor_nbytes(t.dtype, _numel(t.shape)) or 0)
            for name, t in stored
        ]
        total = sum(leaf["bytes"] for leaf in leaves)
    elif item.kind == "pytree":
        meta = _restore.metadata(item.loc)
        leaves = [
            _leaf(x.path, x.shape, None if x.dtype is None else str(x.dtype), x.sharding, x.nbytes)
            for x in meta.leaves.values()
        ]
        total = int(meta.total_bytes)
    else:
        return {**described, "note": _OPAQUE}
    values = sum(_numel(leaf["shape"]) for leaf in leaves if leaf["dtype"])
    return {**described, "leaves": leaves, "total_bytes": total, "values": values}


_OPAQUE = "written by its own checkpointable: its contents are not described"


def _leaf(path: str, shape, dtype: str | None, sharding, nbytes: int) -> dict[str, Any]:
    shape = [int(n) for n in shape]
    return dict(path=path, shape=shape, dtype=dtype, sharding=sharding or None, bytes=int(nbytes))


def _print_item(d: dict[str, Any], *, summary: bool) -> None:
    if "note" in d:
        print(f"\n{d['name']}: {d['kind']} ({d['note']})")
        return
    if "leaves" not in d:
        text = json.dumps(d["value"], sort_keys=True)
        print(f"\n{d['name']}: JSON {text if len(text) <= 200 else text[:197] + '...'}")
        return
    if summary:
        dtypes = sorted({leaf["dtype"] for leaf in d["leaves"] if leaf["dtype"]})
        print(
            f"\n{d['name']}: {len(d['leaves'])} leaves, {d['values']:,} values, "
            f"{human_bytes(d['total_bytes'])}, dtypes {', '.join(dtypes) or '-'}"
        )
        return
    rows = [
        dict(
            name=x["path"],
            shape=str(tuple(x["shape"])),
            dtype=str(x["dtype"]),
            sharding=_sharding_str(x["sharding"]),
            bytes=x["bytes"],
        )
        for x in d["leaves"]
    ]
    print(f"\n{d['name']}:")
    print(make_table(rows) if rows else "(no leaves)")
    print(f"Total: {d['values']:,} values -- {d['total_bytes']:,} bytes")


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def cmd_export(args) -> int:
    if args.dtype is not None and args.dtype not in _SAFETENSORS_DTYPES:
        raise CliError(f"--dtype {args.dtype}: not a safetensors dtype")
    try:  # checked here to be named as flags: the library names its keywords
        _safetensors_plan.checked_cast(args.dtype, "--dtype")
        _safetensors_plan.parse_size(args.max_shard_size, "--max-shard-size")
    except OptionError as e:
        raise CliError(one_line(e)) from None
    # a step or a run: --item, params by default
    chosen = resolve(args.path, args.step, args.item, default="params")[1][0]
    if chosen.kind != "pytree":
        raise CliError(
            f"{chosen.loc}: item {chosen.name!r} holds "
            + (f"a JSON value ({chosen.kind})" if chosen.kind in JSON_KINDS else chosen.kind)
            + ", not a pytree of arrays; export takes a pytree item (--item params, the default)"
        )
    src = chosen.loc
    key_map = _safetensors.key_map_from_file(args.key_map) if args.key_map else None
    try:
        result = _safetensors.export_checkpoint(
            src,
            args.out,
            dtype=args.dtype,
            cast=args.cast,
            max_shard_size=args.max_shard_size,
            key_map=key_map,
            transpose_kernels=args.transpose_kernels,
            force=args.force,
            progress=byte_progress("export"),
            memory_limit_bytes=args.memory_limit,
        )
    except StructureError as e:  # the cast's advice in the command line's words
        raise CliError(one_line(with_advice(e, "--cast unsafe casts anyway"))) from e
    where = result.index or result.files[0]
    print(
        f"exported {result.tensors} tensors ({human_bytes(result.total_bytes)}) from {src} to "
        f"{where}" + (f" ({len(result.files)} files)" if result.index else "")
    )
    return 0


def _locked(e: DirectoryLockedError, refusal: str, instead: str) -> CliError:
    """A live writer's lock, in the command line's words."""
    return CliError(
        f"{one_line(e).split(';')[0]}; {refusal} while a training job writes there: "
        f"run it once the job has stopped{instead}"
    )


def cmd_import(args) -> int:
    try:
        steps = import_checkpoint(
            args.source,
            args.out,
            step=args.step,
            force=args.force,
            format_version=args.format_version,
            progress=byte_progress("import"),
            memory_limit_bytes=args.memory_limit,
        )
    except DirectoryLockedError as e:
        raise _locked(e, "import writes nothing", ", or import into another directory") from None
    print(f"imported step(s) {', '.join(map(str, steps))} from {args.source} into {args.out}")
    return 0


def cmd_gc(args) -> int:
    loc = Location.from_path(args.directory)
    _check_run_directory(loc)
    found = gc_plan(loc, keep=args.keep, keep_every=args.keep_every)
    # Not a run: no writer opened, no lock left there.
    idle = not (found.unfinished or found.steps or found.kept)
    if idle:
        _refuse_other_places(loc, found)
    # what exports that died left here: removed as unfinished
    exports = found.exports
    if found.exports and not args.dry_run:  # checked again now: never a live writer's
        exports = _remains.remove_dead(loc.path.rstrip("/"))
    if not (args.dry_run or idle):
        _report_gc(loc, args, *_gc_with_writer(loc, args, exports))
        return 0
    if args.dry_run and (holder := _writer_now(loc)) is not None:
        warnings.warn(  # a real gc would refuse; its staging is not to remove
            f"a training job writes to {loc} now ({holder}): a real gc would refuse "
            f"until it stops, and the unfinished entries listed may be its saves in flight",
            stacklevel=1,
        )
    _report_gc(loc, args, found.unfinished + exports, found.steps, found.kept, found.left_alone)
    return 0


def _check_run_directory(loc: Location) -> None:
    """Refuses a ``gc`` of no directory, or of one checkpoint rather than a run."""
    if not loc.is_dir():
        is_file = loc.is_local and os.path.isfile(loc.path.rstrip("/"))
        raise CliError(
            f"{loc}: " + ("a file, not a run directory" if is_file else "no such directory")
        )
    if (what := names_one(loc)) is not None:
        raise CliError(
            f"{loc} is {what}, not a run directory: gc removes the unfinished and the old "
            f"steps of a run directory (give the directory that holds the steps)"
        )


def _refuse_other_places(loc: Location, found) -> None:
    """``loc`` holds nothing of a run: refused where it is one level too high or too low
    (a cron job's gc would free nothing, every day) or another library's run."""
    if found.left_alone and not any(loc.exists(n) for n in _steps.RECORD_NAMES):
        if (where := _steps.misplaced(loc)) is not None:
            raise CliError(f"{where}: gc removes nothing here")
    if (other := _foreign.foreign_run(loc)) is not None:
        raise CliError(
            f"{loc} holds {other}, no step of this library: gc removes only this library's steps "
            f"(`flax-orbax import {shell_word(loc)} OUT` converts it)"
        )


def _gc_with_writer(loc: Location, args, exports: list[str]) -> tuple[list, list, list, list]:
    """A real gc under the directory's lock (refused while a training job writes):
    (unfinished removed, steps removed, steps kept, entries left alone)."""
    before = _steps.list_directory(loc)
    try:
        with (
            status(f"gc {loc}"),
            CheckpointManager(loc, keep=args.keep, keep_every=args.keep_every) as mngr,
        ):
            removed = mngr.gc()
    except DirectoryLockedError as e:
        raise _locked(e, "gc removes nothing", " (--dry-run reads only, and works now)") from None
    after = _steps.list_directory(loc)
    left = list(after.unfinished) + list(after.foreign)  # a dead core save's staging is foreign
    unfinished = [n for n in before.unfinished + before.foreign if n not in left]
    unfinished += [n for n in exports if n not in unfinished]
    return unfinished, removed, list(after.committed), left


def _report_gc(loc: Location, args, unfinished, removed, kept, left) -> None:
    if args.json:
        emit(
            {
                "directory": str(loc),
                "dry_run": bool(args.dry_run),
                "removed_unfinished": unfinished,
                "removed_steps": list(removed),
                "kept_steps": kept,
                "left_alone": left,
            }
        )
        return
    verb = "would remove" if args.dry_run else "removed"
    steps = ", ".join(map(str, removed)) or "none"
    print(f"{verb} unfinished: {', '.join(unfinished) or 'none'}")
    print(f"{verb} steps: {'none (no --keep given)' if args.keep is None else steps}")
    kept_verb = "would keep" if args.dry_run else "kept"
    print(f"{kept_verb} steps: {', '.join(map(str, kept)) or 'none'}")
    if left:
        print(f"not steps of this library (left alone): {', '.join(left)}")
    if args.dry_run:  # a user's files in the steps it would remove stay (a real gc warns)
        inside = [f"{s}/{n}" for s in removed for n in _ownership.strangers(loc.child(str(s)))]
        if inside:
            print(f"would leave what this library did not write: {', '.join(inside)}")
        print("dry run: nothing was removed")


def _writer_now(loc: Location) -> str | None:
    """Who writes to ``loc`` now: the holder of its lock (local) or lease (a store)."""
    return live_holder(loc.path) if loc.is_local else _lease.live_holder(loc)


@dataclasses.dataclass(frozen=True)
class GcPlan:
    """What ``gc`` would remove, keep and leave alone (``exports``: what dead exports left)."""

    unfinished: list[str]
    steps: list[int]
    kept: list[int]
    left_alone: list[str]
    exports: list[str] = dataclasses.field(default_factory=list)


def gc_plan(loc: Location, *, keep: int | None, keep_every: int | None) -> GcPlan:
    """What ``gc`` would do to ``loc`` now, by reading only: the writer's housekeeping and
    retention rules asked without a writer (no lock; a test compares their answers)."""
    listing = _steps.list_directory(loc)
    finishing = [n for n in listing.unfinished if rolls_forward(loc, n, listing)]
    unfinished = [n for n in listing.unfinished if n not in finishing and _proven(loc.child(n))]
    foreign_gone = []
    kinds = loc.child_kinds() if loc.is_local else {}
    for name in listing.foreign:
        entry = loc.child(name)
        if loc.is_local:
            staging = kinds.get(name) == "dir" and _steps.SAVE_STAGING_RE.match(name)
            if staging and _liveness.is_dead(entry) and _proven(entry):
                foreign_gone.append(name)
        elif _steps.is_step_name(name) and _proven(entry):
            foreign_gone.append(name)
    committed = sorted(listing.committed)
    doomed: list[int] = []
    if keep is not None:
        policy = Retention(keep=keep, keep_every=keep_every).rule  # its checks, then rules
        doomed = sound_steps_to_delete(
            committed,
            policy,
            whole=lambda s: _steps.manifest_damage(loc, s) is None,
            protected=committed[-1:],
        )
    exports = _remains.dead(loc.path.rstrip("/")) if loc.is_local else []
    done = unfinished + foreign_gone + finishing + exports
    left = [n for n in listing.unfinished + listing.foreign if n not in done]
    return GcPlan(
        unfinished=unfinished + foreign_gone,
        steps=doomed,
        kept=[s for s in committed if s not in doomed],
        left_alone=left,
        exports=exports,
    )


def _proven(loc: Location) -> bool:
    """Whether housekeeping would remove ``loc``: proven ours, or an empty local folder."""
    try:
        if _ownership.proof(loc) is not None:
            return True
    except (ForeignEntryError, CheckpointError):
        return False
    return loc.is_local and _ownership.is_empty(loc)
