"""After the arguments parse: each path argument checked, then the command, its module
alone imported (``list`` loads neither JAX nor tensorstore). Errors propagate to ``main``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from .. import _errors
from .._storage.local_inputs import local_path
from .._storage.location import spec_from_path
from .._storage.store_errors import refusal
from .native_logs import aws_lines_filtered
from .output import EXIT_STORE, CliError, one_line

COMMANDS = {
    "list": ("list_command", "cmd_list"),
    "inspect": ("commands", "cmd_inspect"),
    "verify": ("verify_command", "cmd_verify"),
    "export": ("commands", "cmd_export"),
    "import": ("commands", "cmd_import"),
    "gc": ("commands", "cmd_gc"),
}


def command(name: str) -> Callable[[argparse.Namespace], int]:
    """The function of command ``name``, its module imported now (and only it)."""
    module, function = COMMANDS[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


# Every path argument, by command: (attribute, its name in messages, where it may be:
# "store" any location the library takes, "local" a local file only).
_NOTE = {"out": "safetensors files are written to local disk; export there, then copy them"}
PATH_ARGUMENTS = {
    "list": (("directory", "DIRECTORY", "store"), ("plot", "--plot", "local")),
    "inspect": (("path", "PATH", "store"), ("plot", "--plot", "local")),
    "verify": (("path", "PATH", "store"),),
    "export": (
        ("path", "PATH", "store"),
        ("out", "OUT", "local"),
        ("key_map", "--key-map", "local"),
    ),
    "import": (("source", "SOURCE", "store"), ("out", "OUT", "store")),
    "gc": (("directory", "DIRECTORY", "store"),),
}


_LOST = (
    "from a shell nothing is there, and what this command writes is lost when it exits "
    "(use a local path, s3:// or gs://)"
)


class StoreAccessError(CliError):
    """An object store refused: no such bucket, no credentials, access denied."""

    exit_code = EXIT_STORE


def check_paths(args: argparse.Namespace, *, in_process: bool = False) -> list[dict]:
    """The specs of the store paths; CliError for a path argument naming no place it may be."""
    specs = []
    for attr, name, where in PATH_ARGUMENTS[args.command]:
        value = getattr(args, attr)
        if value is None:
            continue
        try:
            if where == "local":
                local_path(value, what=name, note=_NOTE.get(attr, ""))
                continue
            specs.append(spec_from_path(value, what=name))
            if specs[-1]["driver"] != "memory":
                continue
            said = f"{name} {value!r}: memory:// lives inside one process"
            if attr == "out" and not in_process:
                raise ValueError(f"{said}: {_LOST}")
            # main() called in-process (tests) shares its memory:// store
            print(f"flax-orbax {args.command}: warning: {said}; {_LOST}", file=sys.stderr)
        except ValueError as e:
            raise CliError(one_line(e)) from None
    return specs


def run(
    args: argparse.Namespace,
    command: Callable[[argparse.Namespace], int],
    *,
    in_process: bool = False,
) -> int:
    """``command``'s exit status, its paths checked first; on an object store AWS log
    lines kept off stderr, a refusal one :class:`StoreAccessError` line."""
    specs = check_paths(args, in_process=in_process)
    remote = [s for s in specs if s["driver"] in ("s3", "gcs")]
    with aws_lines_filtered(enabled=any(s["driver"] == "s3" for s in remote)):
        try:
            return command(args)
        except CliError:
            raise
        except _errors.StoreAccessError as e:  # exit 3 too
            raise StoreAccessError(one_line(e)) from None
        except Exception as e:
            line = next((str(x) for s in remote if (x := refusal(e, s))), None)
            if line is None:
                raise
            raise StoreAccessError(line) from None
