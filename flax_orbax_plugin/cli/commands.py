"""One function per ``flax-orbax`` command (``cmd_<name>(args) -> exit status``;
``list`` is in ``list_command``, ``verify`` in ``verify_command``).

PATH is a checkpoint directory (the latest step, or ``--step N``), one step
(``DIR/<step>``), one checkpointable (``DIR/<step>/params``) or a core checkpoint, on
local disk, ``s3://`` or ``gs://``: the CLI is a client of the library (the same
layout, steps and verify modules), so it works wherever the library does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

from .._core import ownership as _removing
from .._core import restore as _restore
from .._errors import (
    DirectoryLockedError,
    OptionError,
    StructureError,
)
from .._format import foreign as _foreign
from .._format import steps as _places
from .._format import steps as _steps
from .._interop import safetensors as _safetensors
from .._interop.importing import import_checkpoint
from .._interop.safetensors import DTYPE_NAMES as _SAFETENSORS_DTYPES
from .._interop.safetensors import plan as _safetensors_plan
from .._interop.safetensors.headers import read_safetensors_index
from .._interop.safetensors.packing import tensor_nbytes
from .._like.onto_like import with_advice
from .._manager.checkpointables import COPY_KINDS
from .._manager.manager import CheckpointManager
from .._storage import lease as _lease
from .._storage.location import Location
from .._storage.lock import live_holder
from . import json_output, plot
from .display import byte_progress, make_table, status
from .gc_plan import plan as gc_plan
from .gc_plan import remove_exports
from .output import CliError, human_bytes, one_line, shell_word
from .paths import JSON_KINDS, names_one, read_json_item, resolve


@dataclasses.dataclass
class _LeafRow:
    name: str
    shape: str
    dtype: str
    sharding: str
    bytes: int


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
        plot.check_output(args.plot)
    label, items = resolve(args.path, args.step, args.item)
    described = [_describe_item(item) for item in items]
    grand_total = sum(d.get("total_bytes", 0) for d in described)
    if args.plot:
        bars = [
            plot.Bar(f"{d['name']}/{leaf['path']}", d["name"], leaf["bytes"])
            for d in described
            for leaf in d.get("leaves", ())
        ]
        plot.leaves_figure(label, bars, args.plot)
    if args.json:
        json_output.emit({"path": label, "items": described, "total_bytes": grand_total})
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
    """One item of ``inspect --json``: a pytree's leaves (metadata only), a JSON item's
    value, a Hugging Face shards item's tensors (their headers), or only the kind of an
    item whose contents belong to its checkpointable (a custom one: never read as JSON)."""
    if item.kind in JSON_KINDS:
        return {"name": item.name, "kind": item.kind, "value": read_json_item(item)}
    if item.kind in COPY_KINDS:
        return _describe_shards(item)
    if item.kind != "pytree":
        return {"name": item.name, "kind": item.kind, "note": _OPAQUE}
    meta = _restore.metadata(item.loc)
    leaves = [
        {
            "path": leaf.path,
            "shape": [int(n) for n in leaf.shape],
            "dtype": None if leaf.dtype is None else str(leaf.dtype),
            "sharding": leaf.sharding or None,
            "bytes": int(leaf.nbytes),
        }
        for leaf in meta.leaves.values()
    ]
    values = sum(_numel(leaf.shape) for leaf in meta.leaves.values() if leaf.dtype)
    return {
        "name": item.name,
        "kind": "pytree",
        "leaves": leaves,
        "total_bytes": int(meta.total_bytes),
        "values": values,
    }


_OPAQUE = "written by its own checkpointable: its contents are not described"


def _describe_shards(item) -> dict[str, Any]:
    """An item of safetensors shards (``fop.HFShards``): its tensors from the files'
    headers (no tensor data read), as leaves named by tensor; on an object store only
    its kind (the shards are read from local disk)."""
    if not item.loc.is_local:
        note = "Hugging Face shards on an object store: copy the folder down to list them"
        return {"name": item.name, "kind": item.kind, "note": note}
    stored = read_safetensors_index(item.loc.path)
    leaves = [
        {
            "path": name,
            "shape": list(t.shape),
            "dtype": str(t.dtype),
            "sharding": None,
            "bytes": tensor_nbytes(t.dtype, _numel(t.shape)) or 0,
        }
        for name, t in sorted(stored.items())
    ]
    return {
        "name": item.name,
        "kind": item.kind,
        "leaves": leaves,
        "total_bytes": sum(leaf["bytes"] for leaf in leaves),
        "values": sum(_numel(leaf["shape"]) for leaf in leaves),
    }


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
        _LeafRow(
            name=leaf["path"],
            shape=str(tuple(leaf["shape"])),
            dtype=str(leaf["dtype"]),
            sharding=_sharding_str(leaf["sharding"]),
            bytes=leaf["bytes"],
        )
        for leaf in d["leaves"]
    ]
    print(f"\n{d['name']}:")
    print(make_table(rows) if rows else "(no leaves)")
    print(f"Total: {d['values']:,} values -- {d['total_bytes']:,} bytes")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# -- export --------------------------------------------------------------------------


def cmd_export(args) -> int:
    if args.format != "safetensors":
        raise CliError(f"unknown export format {args.format!r} (supported: safetensors)")
    if args.dtype is not None and args.dtype not in _SAFETENSORS_DTYPES:
        raise CliError(f"--dtype {args.dtype}: not a safetensors dtype")
    try:  # checked here to be named as flags: the library names its keywords
        _safetensors_plan.checked_cast(args.dtype, "--dtype")
        _safetensors_plan.parse_size(args.max_shard_size, "--max-shard-size")
    except OptionError as e:
        raise CliError(one_line(e)) from None
    if args.dtype is None and args.cast != "safe":
        raise CliError(f"--cast {args.cast} does nothing without --dtype (no leaf is cast)")
    # PATH a core checkpoint or an item: that one (another --item is refused); a step
    # or a run: --item, params by default.
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


# -- import ------------------------------------------------------------------------------


def _locked(e: DirectoryLockedError, refusal: str, instead: str) -> CliError:
    """A live writer's lock, in the command line's words (not the library's keywords)."""
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


# -- gc --------------------------------------------------------------------------------


def cmd_gc(args) -> int:
    loc = Location.from_path(args.directory)
    if args.keep_every is not None and args.keep is None:
        raise CliError(f"--keep-every {args.keep_every} does nothing without --keep N")
    if not loc.is_dir():
        is_file = loc.is_local and os.path.isfile(loc.path.rstrip("/"))
        raise CliError(
            f"{loc}: " + ("a file, not a run directory" if is_file else "no such directory")
        )
    if (what := names_one(loc)) is not None:  # it found nothing to do there: exit 0 was wrong
        raise CliError(
            f"{loc} is {what}, not a run directory: gc removes the unfinished and the old "
            f"steps of a run directory (give the directory that holds the steps)"
        )
    found = gc_plan(loc, keep=args.keep, keep_every=args.keep_every)
    # Not a run (nothing of ours to remove or keep): no writer opened, no lock left there.
    idle = not (found.unfinished or found.steps or found.kept)
    if idle and found.left_alone and not any(loc.exists(n) for n in _steps.RECORD_NAMES):
        # Pointed one level too high or too low (a cron job's gc would free nothing,
        # every day, with exit 0); a folder of other things is fine (nothing to do)
        if (where := _places.misplaced(loc)) is not None:
            raise CliError(f"{where}: gc removes nothing here")
    if idle and (other := _foreign.foreign_run(loc)) is not None:  # another library's run
        raise CliError(
            f"{loc} holds {other}, no step of this library: gc removes only this library's "
            f"steps (`flax-orbax import {shell_word(loc)} OUT` converts it into steps of this "
            f"library)"
        )
    # what exports that died left here (their writers gone): removed as unfinished
    exports = found.exports if args.dry_run else remove_exports(loc, found)
    if args.dry_run or idle:
        removed_unfinished, removed, kept = found.unfinished + exports, found.steps, found.kept
        left = found.left_alone
        holder = None if not args.dry_run else _writer_now(loc)
        if holder is not None:  # a real gc would refuse; its staging is not to remove
            warnings.warn(
                f"a training job writes to {loc} now ({holder}): a real gc would refuse "
                f"until it stops, and the unfinished entries listed may be its saves in flight",
                stacklevel=1,
            )
    else:
        before = _steps.list_directory(loc)
        # Opening a writer takes the directory's lock (refused while a training job
        # writes to it) and removes unfinished steps.
        try:
            with (
                status(f"gc {loc}"),
                CheckpointManager(loc, keep=args.keep, keep_every=args.keep_every) as mngr,
            ):
                removed = mngr.gc()
        except DirectoryLockedError as e:
            raise _locked(
                e, "gc removes nothing", " (--dry-run reads only, and works now)"
            ) from None
        after = _steps.list_directory(loc)
        left = list(after.unfinished) + list(after.foreign)  # a dead core save's staging is foreign
        removed_unfinished = [n for n in before.unfinished + before.foreign if n not in left]
        removed_unfinished += [n for n in exports if n not in removed_unfinished]
        kept = list(after.committed)
    if args.json:
        json_output.emit(
            {
                "directory": str(loc),
                "dry_run": bool(args.dry_run),
                "removed_unfinished": removed_unfinished,
                "removed_steps": list(removed),
                "kept_steps": kept,
                "left_alone": left,
            }
        )
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} unfinished: {', '.join(removed_unfinished) or 'none'}")
    if args.keep is None:
        print(f"{verb} steps: none (no --keep given)")
    else:
        print(f"{verb} steps: {', '.join(map(str, removed)) or 'none'}")
    kept_verb = "would keep" if args.dry_run else "kept"
    print(f"{kept_verb} steps: {', '.join(map(str, kept)) or 'none'}")
    if left:
        print(f"not steps of this library (left alone): {', '.join(left)}")
    if args.dry_run:  # a user's files in the steps it would remove stay (a real gc warns)
        inside = [f"{s}/{n}" for s in removed for n in _removing.strangers(loc.child(str(s)))]
        if inside:
            print(f"would leave what this library did not write: {', '.join(inside)}")
        print("dry run: nothing was removed")
    return 0


def _writer_now(loc: Location) -> str | None:
    """Who writes to ``loc`` now: the holder of a local directory's lock, or of an
    object store's lease (a real gc is refused while there is one)."""
    return live_holder(loc.path) if loc.is_local else _lease.live_holder(loc)


# -- entry point -------------------------------------------------------------------------
