"""One function per ``flax-orbax`` command (``cmd_<name>(args) -> exit status``).

PATH is a checkpoint directory (the latest step, or ``--step N``), one step
(``DIR/<step>``), one checkpointable (``DIR/<step>/params``) or a core checkpoint, on
local disk, ``s3://`` or ``gs://``: the CLI is a client of the library (the same
layout, steps and verify modules), so it works wherever the library does.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from typing import Any

from .._core import restore as _restore
from .._core.verify import verify
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import steps as _steps
from .._format.layout import COMMIT_FILE, MANIFEST_FILE
from .._interop import safetensors as _safetensors
from .._interop.importing import import_checkpoint
from .._interop.safetensors import DTYPE_NAMES as _SAFETENSORS_DTYPES
from .._manager.manager import CheckpointManager
from .._reading import items as _items
from .._storage.location import Location
from .output import EXIT_DAMAGED, CliError, Progress, human_bytes, make_table, one_line
from .paths import describe_missing, dir_bytes, load_extras, read_json_item, resolve

# -- output helpers -------------------------------------------------------------


# -- locating checkpoints ---------------------------------------------------------


# -- commands ---------------------------------------------------------------------


def cmd_list(args) -> int:
    loc = Location.from_path(args.directory)
    if _list_one_checkpoint(loc):
        return 0
    listing = _steps.list_directory(loc)
    if not loc.is_dir() or _steps.foreign_format_hint(loc):
        raise CliError(describe_missing(loc, listing))
    if not listing.committed:
        print(describe_missing(loc, listing))
    else:
        print(f"{loc}: {len(listing.committed)} step(s)")
        rows = [_list_row(loc, step) for step in listing.committed]
        print(make_table(rows))
    if listing.unfinished:
        print(
            f"unfinished (not steps; `flax-orbax gc` removes them): {', '.join(listing.unfinished)}"
        )
    if listing.corrupt:
        print(f"set aside as damaged (kept): {', '.join(listing.corrupt)}")
    if listing.foreign:
        print(f"not steps of this library (left alone): {', '.join(listing.foreign)}")
    return 0


def _list_one_checkpoint(loc: Location) -> bool:
    """``list`` of a step, of a step's item or of a core checkpoint: what it is (and a
    step's row and items), instead of calling its contents "not steps"; False for
    anything else (a directory of steps, or nothing of ours)."""
    if loc.exists(MANIFEST_FILE):
        manifest = _steps.read_manifest(loc)
        print(f"{loc}: step {manifest.step} of the run directory {loc.parent}")
        print(make_table([_list_row(loc.parent, manifest.step, step_loc=loc)]))
        kinds = ", ".join(f"{n} ({e.kind})" for n, e in sorted(manifest.items.items()))
        print(f"items: {kinds}")
        return True
    item = _items.step_item(loc)
    if item is not None:
        what = "its leaves" if item.is_pytree else "its value"
        print(f"{loc}: {item.label} of the run directory {loc.parent.parent}")
        print(f"`flax-orbax inspect {loc}` shows {what}, `flax-orbax verify {loc}` checks it")
        return True
    if loc.exists(COMMIT_FILE):
        print(f"{loc}: a checkpoint of one pytree (fop.save), not a directory of steps")
        print(f"`flax-orbax inspect {loc}` shows its leaves, `flax-orbax verify {loc}` checks it")
        return True
    return False


def _list_row(loc: Location, step: int, *, step_loc: Location | None = None) -> _ListRow:
    step_loc = step_loc or _steps.step_location(loc, step)
    size = dir_bytes(step_loc)
    try:
        manifest = _steps.read_manifest(step_loc)
    except CheckpointError as e:
        return _ListRow(str(step), "?", "?", "?", "?", f"DAMAGED: {one_line(e)}", "-")
    metrics = {
        k: v
        for k, v in load_extras(step_loc).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return _ListRow(
        step=str(step),
        size="?" if size is None else human_bytes(size),
        written="-" if manifest.bytes_written is None else human_bytes(manifest.bytes_written),
        reused="-" if manifest.bytes_reused is None else human_bytes(manifest.bytes_reused),
        saved=datetime.datetime.fromtimestamp(manifest.time).strftime("%Y-%m-%d %H:%M:%S"),
        items=",".join(sorted(manifest.items)),
        metrics=" ".join(f"{k}={_metric(v)}" for k, v in sorted(metrics.items())) or "-",
    )


def _metric(value: int | float) -> str:
    """A metric in 4 significant digits; an int past a float's range too (no OverflowError)."""
    try:
        return f"{value:.4g}"
    except OverflowError:
        digits, sign = str(abs(value)), "-" if value < 0 else ""
        return f"{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1}"


@dataclasses.dataclass
class _ListRow:
    """One step: its size on a local disk; the array bytes its save wrote and those it
    took unchanged from the previous step (incremental), from the manifest."""

    step: str
    size: str
    written: str
    reused: str
    saved: str
    items: str
    metrics: str


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
    label, items = resolve(args.path, args.step)
    if args.item is not None:
        chosen = [i for i in items if i.name == args.item]
        if not chosen:
            raise CliError(
                f"{label} has no item {args.item!r} (it has: {', '.join(i.name for i in items)})"
            )
        items = chosen
    print(label)
    grand_total = 0
    for item in items:
        if item.kind != "pytree":
            text = json.dumps(read_json_item(item), sort_keys=True)
            print(f"\n{item.name}: JSON {text if len(text) <= 200 else text[:197] + '...'}")
            continue
        meta = _restore.metadata(item.loc)
        count = sum(_numel(leaf.shape) for leaf in meta.leaves.values() if leaf.dtype)
        grand_total += meta.total_bytes
        if args.summary:
            dtypes = sorted({str(leaf.dtype) for leaf in meta.leaves.values() if leaf.dtype})
            print(
                f"\n{item.name}: {len(meta.leaves)} leaves, {count:,} values, "
                f"{human_bytes(meta.total_bytes)}, dtypes {', '.join(dtypes) or '-'}"
            )
            continue
        rows = [
            _LeafRow(
                name=leaf.path,
                shape=str(tuple(leaf.shape)),
                dtype=str(leaf.dtype),
                sharding=_sharding_str(leaf.sharding),
                bytes=leaf.nbytes,
            )
            for leaf in meta.leaves.values()
        ]
        print(f"\n{item.name}:")
        print(make_table(rows) if rows else "(no leaves)")
        print(f"Total: {count:,} values -- {meta.total_bytes:,} bytes")
    print(f"\nAll arrays: {grand_total:,} bytes ({human_bytes(grand_total)})")
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def cmd_verify(args) -> int:
    try:
        results = verify(args.path, step=args.step, all_steps=args.all)
    except CheckpointError as e:
        # Nothing checkable at PATH: a usage error, unless something is there but broken.
        loc = Location.from_path(args.path)
        if loc.is_dir() and not isinstance(e, CheckpointNotFoundError):
            print(f"DAMAGED  {loc}: {one_line(e)}")
            return EXIT_DAMAGED
        raise CliError(one_line(e)) from None
    damaged = [r for r in results if not r.ok]
    for r in results:
        label = r.path if r.step is None else f"step {r.step}" + (f"/{r.item}" if r.item else "")
        if r.ok:
            print(f"ok       {label}")
        else:
            print(f"DAMAGED  {label}: {one_line(r.error or '')}")
    if damaged:
        names = ", ".join(
            r.path if r.step is None else f"{r.step}" + (f"/{r.item}" if r.item else "")
            for r in damaged
        )  # a step whose manifest fails has no item: it read "1/None"
        print(f"verify: {len(damaged)} damaged: {names}", file=sys.stderr)
        return EXIT_DAMAGED
    print(f"verify: all {len(results)} checkpointable(s) ok")
    return 0


# -- export --------------------------------------------------------------------------


def cmd_export(args) -> int:
    if args.format != "safetensors":
        raise CliError(f"unknown export format {args.format!r} (supported: safetensors)")
    if args.dtype is not None and args.dtype not in _SAFETENSORS_DTYPES:
        raise CliError(f"--dtype {args.dtype}: not a safetensors dtype")
    label, items = resolve(args.path, args.step)
    found = {i.name: i for i in items}
    if args.item not in found and len(items) == 1 and items[0].kind == "pytree":
        found[args.item] = items[0]  # PATH is one pytree
    if args.item not in found:
        raise CliError(f"{label} has no {args.item!r} (it has: {', '.join(found)})")
    if found[args.item].kind != "pytree":
        chosen = found[args.item]
        raise CliError(
            f"{chosen.loc}: item {chosen.name!r} holds a JSON value ({chosen.kind}), not "
            f"arrays; export takes a pytree item (--item params, the default)"
        )
    src = found[args.item].loc
    key_map = _safetensors.key_map_from_file(args.key_map) if args.key_map else None
    result = _safetensors.export_checkpoint(
        src,
        args.out,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        key_map=key_map,
        transpose_kernels=args.transpose_kernels,
        force=args.force,
        progress=lambda total: Progress(max(total, 1), "export"),
    )
    where = result.index or result.files[0]
    print(
        f"exported {result.tensors} tensors ({human_bytes(result.total_bytes)}) from {src} to "
        f"{where}" + (f" ({len(result.files)} files)" if result.index else "")
    )
    return 0


# -- import ------------------------------------------------------------------------------


def cmd_import(args) -> int:
    steps = import_checkpoint(
        args.source,
        args.out,
        step=args.step,
        force=args.force,
        format_version=args.format_version,
    )
    print(f"imported step(s) {', '.join(map(str, steps))} from {args.source} into {args.out}")
    return 0


# -- gc --------------------------------------------------------------------------------


def cmd_gc(args) -> int:
    loc = Location.from_path(args.directory)
    if not loc.is_dir():
        raise CliError(f"{loc}: no such directory")
    before = _steps.list_directory(loc)
    # Opening a writer takes the directory's lock (refused while a training job
    # writes to it) and removes unfinished steps.
    with CheckpointManager(loc, keep=args.keep, keep_every=args.keep_every) as mngr:
        removed = mngr.gc()
    after = _steps.list_directory(loc)
    left = set(after.unfinished) | set(after.foreign)  # a dead core save's staging is foreign
    gone = [n for n in before.unfinished + before.foreign if n not in left]
    print(f"removed unfinished: {', '.join(gone) or 'none'}")
    if args.keep is None:
        print("removed steps: none (no --keep given)")
    else:
        print(f"removed steps: {', '.join(map(str, removed)) or 'none'}")
    print(f"kept steps: {', '.join(map(str, after.committed)) or 'none'}")
    if after.foreign:
        print(f"not steps of this library (left alone): {', '.join(after.foreign)}")
    return 0


# -- entry point -------------------------------------------------------------------------
