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


class StoreAccessError(CliError):
    """An object store refused: no such bucket, no credentials, access denied."""

    exit_code = EXIT_STORE


def check_paths(args: argparse.Namespace, *, in_process: bool = False) -> list[dict]:
    """The specs of the store paths; CliError naming the first path argument that names
    no place it may be, or a memory:// OUT from a shell; a warning for another memory://."""
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
            if specs[-1]["driver"] == "memory" and attr == "out" and not in_process:
                raise ValueError(
                    f"{name} {value!r}: memory:// lives inside one process: what this "
                    f"command writes there is lost when it exits (use a local path, s3:// "
                    f"or gs://)"
                )
            if specs[-1]["driver"] == "memory":
                print(  # main() called in-process (tests) shares its memory:// store
                    f"flax-orbax {args.command}: warning: {name} {value!r}: memory:// lives "
                    f"inside one process; from a shell nothing is there, and what this "
                    f"command writes is lost when it exits (use a local path, s3:// or gs://)",
                    file=sys.stderr,
                )
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
    lines kept off stderr, a refusal one :class:`StoreAccessError` line. ``in_process``:
    ``main(argv)`` called from Python."""
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
