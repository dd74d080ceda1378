"""The ``flax-orbax`` parser and entry point: one command per subcommand, errors as
one line on stderr and an exit status (1: damage found by ``verify``, 2: anything else).
"""

from __future__ import annotations

import argparse
import os
import sys

from .._errors import CheckpointError
from .._storage.kvstore import local_path, spec_from_path
from .commands import cmd_export, cmd_gc, cmd_import, cmd_inspect, cmd_list, cmd_verify
from .output import EXIT_ERROR, CliError, one_line


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
    s.add_argument(
        "--format-version", type=int, choices=(1, 2), default=1, help="of the steps written"
    )
    s.set_defaults(fn=cmd_import)

    s = sub.add_parser("gc", help="apply retention and remove unfinished steps")
    s.add_argument("directory")
    s.add_argument("--keep", type=int, default=None, help="keep the last N steps")
    s.add_argument("--keep-every", type=int, default=None, help="and every step divisible by K")
    s.set_defaults(fn=cmd_gc)
    return p


# Every path argument, by command: (attribute, its name in messages, where it may be).
# "store": any location the library reads and writes (local, s3://, gs://, memory://:
# one process's own, so a command started from a shell is warned);
# "local": a file only the local filesystem can serve. Checked before a command runs,
# by the library's one checker of what a path names: a URL is never made a local name.
_NOTE = {"out": "safetensors files are written to local disk; export there, then copy them"}
PATH_ARGUMENTS = {
    "list": (("directory", "DIRECTORY", "store"),),
    "inspect": (("path", "PATH", "store"),),
    "verify": (("path", "PATH", "store"),),
    "export": (
        ("path", "PATH", "store"),
        ("out", "OUT", "local"),
        ("key_map", "--key-map", "local"),
    ),
    "import": (("source", "SOURCE", "store"), ("out", "OUT", "store")),
    "gc": (("directory", "DIRECTORY", "store"),),
}


def check_paths(args: argparse.Namespace) -> None:
    """CliError naming the first path argument that names no place it may be; a
    warning on stderr for each memory:// one."""
    for attr, name, where in PATH_ARGUMENTS[args.command]:
        value = getattr(args, attr)
        if value is None:
            continue
        try:
            if where == "local":
                local_path(value, what=name, note=_NOTE.get(attr, ""))
            elif spec_from_path(value, what=name)["driver"] == "memory":
                print(  # main() called in-process (tests) shares its memory:// store
                    f"flax-orbax {args.command}: warning: {name} {value!r}: memory:// lives "
                    f"inside one process; from a shell nothing is there, and what this "
                    f"command writes is lost when it exits (use a local path, s3:// or gs://)",
                    file=sys.stderr,
                )
        except ValueError as e:
            raise CliError(one_line(e)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_paths(args)
        return args.fn(args)
    except CliError as e:
        print(f"flax-orbax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"flax-orbax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        kind = "" if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: "
        print(f"flax-orbax {args.command}: error: {kind}{one_line(e)}", file=sys.stderr)
        if os.environ.get("FLAX_ORBAX_DEBUG"):
            raise
        return EXIT_ERROR
