"""The ``flax-orbax`` command line (also ``python -m flax_orbax_plugin``).

    flax-orbax list DIR                      steps, sizes, times, metrics
    flax-orbax inspect PATH                  leaves: shapes, dtypes, shardings, bytes
    flax-orbax verify PATH                   every checksum; exit 1 naming what is damaged
    flax-orbax export PATH OUT --format safetensors [--dtype bfloat16]
    flax-orbax gc DIR [--keep N]             retention; remove unfinished steps

PATH is a checkpoint directory (the latest step, or ``--step N``), one step
(``DIR/<step>``), one checkpointable (``DIR/<step>/params``) or a core checkpoint, on
local disk, ``s3://`` or ``gs://``: the CLI is a client of the library (the same
layout, steps and verify modules), so it works wherever the library does.

Progress bars go to stderr when it is a terminal; otherwise output is plain
lines. Errors are one line on stderr and a non-zero exit status: 1 for damage
found by ``verify``, 2 for everything else.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any

from .._core import restore as _restore
from .._core.verify import verify
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import COMMIT_FILE, MANIFEST_FILE, METADATA_FILE
from .._interop import safetensors as _safetensors
from .._interop.importing import import_checkpoint
from .._manager.manager import CheckpointManager
from .._storage.location import Location

__all__ = ["main"]

EXIT_DAMAGED = 1
EXIT_ERROR = 2


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


# -- output helpers -------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int, label: str, *, stream=None, unit: str = ""):
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)()) and total > 0
        self.total, self.done, self.label, self.unit = total, 0, label, unit
        self._last = 0.0

    def advance(self, amount: int = 1, note: str = "") -> None:
        self.done += amount
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.05 and self.done < self.total:
            return
        self._last = now
        width = 30
        filled = int(width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "." * (width - filled)
        pct = 100.0 * self.done / self.total
        self.stream.write(f"\r{self.label} [{bar}] {pct:5.1f}% {note[:40]:<40}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def make_table(rows: list[Any]) -> str:
    from clu import parameter_overview

    return parameter_overview.make_table(rows)


# -- locating checkpoints ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Item:
    name: str
    loc: Location
    kind: str  # "pytree", "json", "step", "data_iterator", ...


def resolve(path: str, step: int | None) -> tuple[str, list[_Item]]:
    """(label, items) for PATH: a core checkpoint, a step, an item, or a directory."""
    loc = Location.from_path(path)
    if loc.exists(COMMIT_FILE):
        return str(loc), [_Item(loc.name, loc, "pytree")]
    if loc.exists(MANIFEST_FILE):
        return str(loc), _step_items(loc)
    manifest = _steps.manifest_for_item(loc)
    if manifest is not None:
        name, entry = next((n, e) for n, e in manifest.items.items() if e.dir == loc.name)
        return str(loc.parent), [_Item(name, loc, entry.kind)]
    listing = _steps.list_directory(loc)
    if not listing.committed:
        raise CliError(_describe_missing(loc, listing))
    chosen = _steps.choose_step(loc, listing.committed, step)
    step_loc = _steps.step_location(loc, chosen)
    return str(step_loc), _step_items(step_loc)


def _describe_missing(loc: Location, listing: _steps.Listing) -> str:
    hint = _steps.foreign_format_hint(loc)
    if hint:
        return f"no checkpoint of this library at {loc}{hint}"
    if loc.is_local and os.path.isfile(loc.path.rstrip("/")):
        return f"{loc} is a file, not a checkpoint directory"
    if not loc.is_dir():
        return f"{loc}: the path does not exist"
    if loc.exists(METADATA_FILE):
        return f"{loc} is a core checkpoint that was never committed (its save died)"
    return f"{loc}: no committed steps" + (
        f" (unfinished: {', '.join(listing.unfinished)})" if listing.unfinished else ""
    )


def _step_items(step_loc: Location) -> list[_Item]:
    manifest = _steps.read_manifest(step_loc)
    return [_Item(n, step_loc.child(e.dir), e.kind) for n, e in sorted(manifest.items.items())]


def _dir_bytes(loc: Location) -> int | None:
    return loc.size_bytes() if loc.is_local else None


def _read_json_item(item: _Item) -> Any:
    name = "process_0.json" if item.kind == "data_iterator" else _layout.JSON_VALUE_FILE
    return _steps.read_item_json(item.loc, name)


def _load_extras(step_loc: Location) -> dict[str, Any]:
    try:
        entry = _steps.read_manifest(step_loc).items.get("extras")
        if entry is None:
            return {}
        value = _steps.read_item_json(step_loc.child(entry.dir), _layout.JSON_VALUE_FILE)
    except CheckpointError:
        return {}
    return value if isinstance(value, dict) else {}


# -- commands ---------------------------------------------------------------------


def cmd_list(args) -> int:
    loc = Location.from_path(args.directory)
    listing = _steps.list_directory(loc)
    if not loc.is_dir() or _steps.foreign_format_hint(loc):
        raise CliError(_describe_missing(loc, listing))
    if not listing.committed:
        print(f"{loc}: no committed steps")
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


def _list_row(loc: Location, step: int) -> _ListRow:
    step_loc = _steps.step_location(loc, step)
    size = _dir_bytes(step_loc)
    try:
        manifest = _steps.read_manifest(step_loc)
    except CheckpointError as e:
        return _ListRow(str(step), "?", "?", "?", "?", f"DAMAGED: {_one_line(e)}", "-")
    metrics = {
        k: v
        for k, v in _load_extras(step_loc).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return _ListRow(
        step=str(step),
        size="?" if size is None else human_bytes(size),
        written="-" if manifest.bytes_written is None else human_bytes(manifest.bytes_written),
        reused="-" if manifest.bytes_reused is None else human_bytes(manifest.bytes_reused),
        saved=datetime.datetime.fromtimestamp(manifest.time).strftime("%Y-%m-%d %H:%M:%S"),
        items=",".join(sorted(manifest.items)),
        metrics=" ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())) or "-",
    )


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
            text = json.dumps(_read_json_item(item), sort_keys=True)
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
            print(f"DAMAGED  {loc}: {_one_line(e)}")
            return EXIT_DAMAGED
        raise CliError(_one_line(e)) from None
    damaged = [r for r in results if not r.ok]
    for r in results:
        label = r.path if r.step is None else f"step {r.step}" + (f"/{r.item}" if r.item else "")
        if r.ok:
            print(f"ok       {label}")
        else:
            print(f"DAMAGED  {label}: {_one_line(r.error or '')}")
    if damaged:
        names = ", ".join(f"{r.step}/{r.item}" if r.step is not None else r.path for r in damaged)
        print(f"verify: {len(damaged)} damaged: {names}", file=sys.stderr)
        return EXIT_DAMAGED
    print(f"verify: all {len(results)} checkpointable(s) ok")
    return 0


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# -- export --------------------------------------------------------------------------

# numpy dtype name -> safetensors dtype tag
_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


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
        raise CliError(f"{found[args.item].loc}: not an array checkpoint")
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
    steps = import_checkpoint(args.source, args.out, step=args.step, force=args.force)
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
    gone = [n for n in before.unfinished if n not in after.unfinished]
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flax-orbax",
        description="Inspect, verify, export and clean flax_orbax_plugin checkpoints.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("list", help="steps in a checkpoint directory: sizes, times, metrics")
    s.add_argument("directory")
    s.set_defaults(fn=cmd_list)

    s = sub.add_parser("inspect", help="leaves with shapes, dtypes, shardings and bytes")
    s.add_argument("path")
    s.add_argument("--step", type=int, default=None)
    s.add_argument("--item", default=None, help="only this checkpointable, e.g. params")
    s.add_argument("--summary", action="store_true", help="one line per item, no leaf table")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("verify", help="read everything and check every checksum")
    s.add_argument("path")
    s.add_argument("--step", type=int, default=None)
    s.add_argument("--all", action="store_true", help="every step, not only the latest")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("export", help="write params to a safetensors file")
    s.add_argument("path")
    s.add_argument("out")
    s.add_argument("--format", default="safetensors", choices=["safetensors"])
    s.add_argument("--dtype", default=None, help="cast floating leaves, e.g. bfloat16")
    s.add_argument("--item", default="params", help="which checkpointable (default: params)")
    s.add_argument("--step", type=int, default=None)
    s.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB (10^9), 2GiB (2^30)")
    s.add_argument("--transpose-kernels", action="store_true", help="PyTorch kernel layout")
    s.add_argument("--key-map", default=None, help="JSON file: {leaf path: tensor name|null}")
    s.add_argument("--force", action="store_true", help="replace an existing export")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("import", help="an Orbax directory or Flax msgpack file(s) as steps")
    s.add_argument("source", help="Orbax manager/step/item directory, msgpack file or dir")
    s.add_argument("out", help="a CheckpointManager directory (created if missing)")
    s.add_argument("--step", type=int, default=None, help="only this step / write as this step")
    s.add_argument("--force", action="store_true", help="replace steps that exist in OUT")
    s.set_defaults(fn=cmd_import)

    s = sub.add_parser("gc", help="apply retention and remove unfinished steps")
    s.add_argument("directory")
    s.add_argument("--keep", type=int, default=None, help="keep the last N steps")
    s.add_argument("--keep-every", type=int, default=None, help="and every step divisible by K")
    s.set_defaults(fn=cmd_gc)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CliError as e:
        print(f"flax-orbax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"flax-orbax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        kind = "" if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: "
        print(f"flax-orbax {args.command}: error: {kind}{_one_line(e)}", file=sys.stderr)
        if os.environ.get("FLAX_ORBAX_DEBUG"):
            raise
        return EXIT_ERROR
