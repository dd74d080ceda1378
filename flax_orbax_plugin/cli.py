"""The ``flax-orbax`` command line (also ``python -m flax_orbax_plugin``).

    flax-orbax list DIR                      steps, sizes, times, metrics
    flax-orbax inspect PATH                  leaves: shapes, dtypes, shardings, bytes
    flax-orbax verify PATH                   every checksum; exit 1 naming what is damaged
    flax-orbax export PATH OUT --format safetensors [--dtype bfloat16]
    flax-orbax gc DIR [--keep N]             retention; remove unfinished steps

PATH is a checkpoint directory (the latest step, or ``--step N``), one step
(``DIR/<step>``), or one checkpointable (``DIR/<step>/params``).

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
import re
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["main"]

EXIT_DAMAGED = 1
EXIT_ERROR = 2

METADATA_FILE = "_METADATA.json"  # a core checkpoint (one pytree)
MANIFEST_FILE = "_CHECKPOINT.json"  # a committed step of a CheckpointManager directory
_TMP_RE = re.compile(r"^[0-9]+\.(partial|deleting)-[0-9a-z]+$")


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


def _is_core_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def _step_dirs(directory: str) -> dict[int, str]:
    """Committed steps (integer names holding a step manifest) under a directory."""
    out = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        raise CliError(f"{directory}: no such directory") from None
    except NotADirectoryError:
        raise CliError(f"{directory}: not a directory") from None
    for name in names:
        if name.isdigit() and os.path.isfile(os.path.join(directory, name, MANIFEST_FILE)):
            out[int(name)] = os.path.join(directory, name)
    return dict(sorted(out.items()))


def _unfinished(directory: str) -> list[str]:
    """Leftovers of saves or deletions that never finished (never listed as steps)."""
    out = []
    for name in os.listdir(directory):
        full = os.path.join(directory, name)
        if not os.path.isdir(full):
            continue
        if _TMP_RE.match(name) or (
            name.isdigit() and not os.path.isfile(os.path.join(full, MANIFEST_FILE))
        ):
            out.append(name)
    return sorted(out)


def resolve(path: str, step: int | None) -> tuple[str, dict[str, str]]:
    """Returns (step_path, {checkpointable name: its path}) for PATH.

    PATH may be a manager directory (its latest step, or ``step``), one step
    directory, one checkpointable of a step, or a lone core checkpoint.
    """
    path = os.path.normpath(path)
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        raise CliError(f"{path}: not a directory")
    parent = os.path.dirname(path)
    if _is_core_checkpoint(path) or os.path.isfile(os.path.join(parent, MANIFEST_FILE)):
        if step is not None:
            raise CliError(f"{path} is one checkpointable; --step does not apply")
        return parent, {os.path.basename(path): path}
    if not os.path.isfile(os.path.join(path, MANIFEST_FILE)):
        steps = _step_dirs(path)
        if not steps:
            raise CliError(f"{path}: not a checkpoint (no committed steps in it)")
        if step is None:
            step = max(steps)
        if step not in steps:
            raise CliError(f"{path}: no step {step}; steps: {', '.join(map(str, steps))}")
        path = steps[step]
    elif step is not None:
        raise CliError(f"{path} is one step; --step does not apply")
    manifest = _read_json_file(os.path.join(path, MANIFEST_FILE))
    names = manifest.get("items") if isinstance(manifest, dict) else None
    if not isinstance(names, dict):
        raise CliError(f"{path}/{MANIFEST_FILE}: not a step manifest")
    return path, {n: os.path.join(path, n) for n in sorted(names)}


def _dir_bytes(path: str) -> int:
    from flax_orbax_plugin._storage import Location

    return Location.from_path(path).size_bytes()


def _read_json_item(path: str) -> Any:
    for name in sorted(os.listdir(path)):
        if name.endswith(".json"):
            with open(os.path.join(path, name)) as f:
                return json.load(f)
    return None


def _load_extras(step_path: str) -> dict[str, Any]:
    extras_dir = os.path.join(step_path, "extras")
    if not os.path.isdir(extras_dir):
        return {}
    try:
        value = _read_json_item(extras_dir)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


# -- commands ---------------------------------------------------------------------


def cmd_list(args) -> int:
    directory = os.path.normpath(args.directory)
    steps = _step_dirs(directory)
    if not steps:
        print(f"{directory}: no committed steps")
    else:
        print(f"{directory}: {len(steps)} step(s)")
        rows = []
        for step, path in steps.items():
            manifest = _read_json_file(os.path.join(path, MANIFEST_FILE))
            saved_at = manifest.get("time") if isinstance(manifest, dict) else None
            if not isinstance(saved_at, (int, float)):
                saved_at = os.path.getmtime(path)
            items = manifest.get("items") if isinstance(manifest, dict) else None
            metrics = {
                k: v
                for k, v in _load_extras(path).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            rows.append(
                _ListRow(
                    step=str(step),
                    size=human_bytes(_dir_bytes(path)),
                    saved=datetime.datetime.fromtimestamp(saved_at).strftime("%Y-%m-%d %H:%M:%S"),
                    items=",".join(sorted(items)) if isinstance(items, dict) else "?",
                    metrics=" ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())) or "-",
                )
            )
        print(make_table(rows))
    pending = _unfinished(directory)
    if pending:
        print(f"unfinished (not steps; `flax-orbax gc` removes them): {', '.join(pending)}")
    return 0


def _read_json_file(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class _ListRow:
    step: str
    size: str
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
    import flax_orbax_plugin as fop

    step_path, items = resolve(args.path, args.step)
    print(f"{step_path}")
    grand_total = 0
    for name, path in items.items():
        if not _is_core_checkpoint(path):
            value = _read_json_item(path)
            text = json.dumps(value, sort_keys=True)
            print(f"\n{name}: JSON {text if len(text) <= 200 else text[:197] + '...'}")
            continue
        meta = fop.metadata(path)
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
        count = sum(_numel(leaf.shape) for leaf in meta.leaves.values() if leaf.dtype)
        print(f"\n{name}:")
        print(make_table(rows) if rows else "(no leaves)")
        print(f"Total: {count:,} values -- {meta.total_bytes:,} bytes")
        grand_total += meta.total_bytes
    print(f"\nAll arrays: {grand_total:,} bytes ({human_bytes(grand_total)})")
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _targets(path: str, step: int | None, all_steps: bool) -> list[tuple[str, dict[str, str]]]:
    if all_steps:
        steps = _step_dirs(os.path.normpath(path))
        if not steps:
            raise CliError(f"{path}: no steps to verify")
        return [resolve(p, None) for p in steps.values()]
    return [resolve(path, step)]


def cmd_verify(args) -> int:
    import flax_orbax_plugin as fop
    from flax_orbax_plugin._errors import CheckpointError

    targets = _targets(args.path, args.step, args.all)
    work = [(n, p) for _, items in targets for n, p in items.items()]
    total_bytes = sum(_dir_bytes(p) for _, p in work)
    damaged: list[str] = []
    checked = 0
    with Progress(max(total_bytes, 1), "verify") as bar:
        for name, path in work:
            label = os.path.relpath(path, os.path.dirname(targets[0][0]))
            try:
                if _is_core_checkpoint(path):
                    n = _verify_core(fop, path)
                    checked += n
                    msg = f"{n} leaves, checksums ok"
                else:
                    _verify_json(path)
                    msg = "JSON ok"
                if not bar.enabled:
                    print(f"ok       {label}: {msg}")
            except (CheckpointError, OSError, ValueError) as e:
                damaged.append(label)
                bar.close()
                print(f"DAMAGED  {label}: {_one_line(e)}")
            bar.advance(_dir_bytes(path), name)
    if damaged:
        print(f"verify: {len(damaged)} damaged: {', '.join(damaged)}", file=sys.stderr)
        return EXIT_DAMAGED
    print(f"verify: all {len(work)} checkpointable(s) ok ({checked} array leaves checked)")
    return 0


def _verify_core(fop, path: str) -> int:
    """Reads every leaf (the zarr3 crc32c of every chunk is checked on read), a group
    at a time; raises CorruptCheckpointError naming the damaged leaves of every bad group."""
    from flax_orbax_plugin._errors import CorruptCheckpointError

    names = list(fop.metadata(path).leaves)
    groups, read = _leaf_groups(fop, path, names)
    errors = []
    for group in groups:
        try:
            read(group)
        except CorruptCheckpointError as e:
            errors.append(_one_line(e))
    if errors:
        raise CorruptCheckpointError("; ".join(errors))
    return len(names)


def _verify_json(path: str) -> None:
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith(".json") and os.path.isfile(full):
            with open(full) as f:
                try:
                    json.load(f)
                except ValueError as e:
                    raise ValueError(f"{name} is not valid JSON ({e})") from None


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


def _export_dtype(stored: str, cast: str | None) -> str:
    if cast is not None and _is_float(stored):
        return cast
    return stored


def _is_float(dtype_name: str) -> bool:
    return dtype_name.startswith(("float", "bfloat"))


def safetensors_header(
    leaves: Iterable[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> bytes:
    """The safetensors header (8-byte length + padded JSON) for (name, dtype, shape) leaves.

    Tensors are laid out back to back in the given order.
    """
    from flax_orbax_plugin._metadata import dtype_from_name

    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in leaves:
        if dtype not in _SAFETENSORS_DTYPES:
            raise CliError(f"leaf {name!r}: dtype {dtype} has no safetensors equivalent")
        size = _numel(shape) * dtype_from_name(dtype, path=name).itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": [int(s) for s in shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


_GROUP_BYTES = 64 << 20  # leaves read per partial restore by export and verify


def _leaf_groups(fop, path: str, names: list[str]) -> tuple[list[list[str]], Any]:
    """Splits ``names`` into groups of at most ~64 MiB and returns (groups, read) where
    ``read(group) -> {leaf path: numpy array}`` restores one group alone.

    A group is a partial restore whose template holds None leaves (numpy results),
    so memory stays bounded whatever the tree's size. Trees with list/tuple nodes
    come back as one group, because a partial template cannot name a single list
    element.
    """
    from flax_orbax_plugin import _restore, _tree
    from flax_orbax_plugin._storage import Location

    doc = _restore.read_document(Location.from_path(path))
    records = {rec["path"]: rec for rec in doc["leaves"]}
    if not all(k[0] in ("dict", "attr") for n in names for k in records[n]["keys"]):

        def read_all(group):
            flat, _ = _tree.flatten(fop.restore(path))
            return {p: v for p, _, v in flat}

        return [list(names)], read_all

    def read(group):
        like = _tree.rebuild(([tuple(k) for k in records[n]["keys"]], None) for n in group)
        flat, _ = _tree.flatten(fop.restore(path, like, partial=True))
        return {p: v for p, _, v in flat}

    meta = fop.metadata(path).leaves
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if groups[-1] and size + meta[name].nbytes > _GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += meta[name].nbytes
    return [g for g in groups if g], read


def _leaf_values(fop, path: str, names: list[str]) -> Iterator[tuple[str, Any]]:
    """Yields (leaf path, numpy array) in ``names`` order, a group at a time."""
    groups, read = _leaf_groups(fop, path, names)
    for group in groups:
        values = read(group)
        for name in group:
            yield name, values.pop(name)


def cmd_export(args) -> int:
    if args.format != "safetensors":
        raise CliError(f"unknown export format {args.format!r} (supported: safetensors)")
    if args.dtype is not None and args.dtype not in _SAFETENSORS_DTYPES:
        raise CliError(f"--dtype {args.dtype}: not a safetensors dtype")
    step_path, items = resolve(args.path, args.step)
    if args.item not in items:
        raise CliError(f"{step_path} has no {args.item!r} (it has: {', '.join(items)})")
    src = items[args.item]
    if not _is_core_checkpoint(src):
        raise CliError(f"{src}: not an array checkpoint")
    from flax_orbax_plugin import _safetensors

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
    from flax_orbax_plugin._importing import import_checkpoint

    steps = import_checkpoint(args.source, args.out, step=args.step, force=args.force)
    print(f"imported step(s) {', '.join(map(str, steps))} from {args.source} into {args.out}")
    return 0


# -- gc --------------------------------------------------------------------------------


def cmd_gc(args) -> int:
    from flax_orbax_plugin._manager import CheckpointManager

    directory = os.path.normpath(args.directory)
    if not os.path.isdir(directory):
        raise CliError(f"{directory}: no such directory")
    unfinished = _unfinished(directory)
    # Opening a writer takes the directory's lock (refused while a training job
    # writes to it) and removes unfinished steps.
    with CheckpointManager(directory, keep=args.keep, keep_every=args.keep_every) as mngr:
        removed = mngr.gc()
    print(f"removed unfinished: {', '.join(unfinished) or 'none'}")
    if args.keep is None:
        print("removed steps: none (no --keep given)")
    else:
        print(f"removed steps: {', '.join(map(str, removed)) or 'none'}")
    print(f"kept steps: {', '.join(map(str, _step_dirs(directory))) or 'none'}")
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
    except Exception as e:  # noqa: BLE001 -- one clear line, never a traceback
        from flax_orbax_plugin._errors import CheckpointError

        kind = "" if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: "
        print(f"flax-orbax {args.command}: error: {kind}{_one_line(e)}", file=sys.stderr)
        if os.environ.get("FLAX_ORBAX_DEBUG"):
            raise
        return EXIT_ERROR
