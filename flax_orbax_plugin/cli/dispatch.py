"""After the arguments parse: each path argument checked, then the command, its module
alone imported (``list`` loads neither JAX nor tensorstore), the AWS C libraries' log lines
kept off the terminal while it talks to S3 (not reentrant). Errors propagate to ``main``.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin.cli.dispatch``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
import threading
from collections.abc import Callable

from .. import _errors
from .._storage.local_inputs import local_path
from .._storage.location import spec_from_path
from .._storage.store_errors import refusal
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


# absl's prefix: severity, MMDD hh:mm:ss.micros, thread id, file:line]
_ABSL = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([^:\]\s]+):\d+\] ")
# tensorstore's own lines name a C/C++ file; the AWS logger names its subject there
# ("common-io", ...), or "aws_api.cc" for a subject without a name.
_SOURCE = re.compile(rb"\.(cc|c|h|cpp|hpp)$")


def is_aws_line(line: bytes) -> bool | None:
    """True for a non-fatal absl line of the AWS libraries, False for any other absl
    line, None for a line without the absl prefix (a continuation or plain text)."""
    m = _ABSL.match(line)
    if m is None:
        return None
    if m.group(1) == b"F":
        return False
    return m.group(2) == b"aws_api.cc" or not _SOURCE.search(m.group(2))


@contextlib.contextmanager
def aws_lines_filtered(*, enabled: bool = True):
    """Descriptor 2 through the filter while the block runs (every line copied on exit)."""
    if not enabled or os.environ.get("FLAX_ORBAX_DEBUG"):
        yield
        return
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (a daemon's closed stderr): nothing to filter
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    copier = threading.Thread(target=_copy, args=(read_end, saved), daemon=True)
    copier.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closes: the copier reads to its end
        copier.join(timeout=10)
        os.close(saved)


def _copy(read_end: int, out: int) -> None:
    dropping = False
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                dropping = _keep(line + b"\n", out, dropping)
        if pending:
            _keep(pending, out, dropping)


def _keep(line: bytes, out: int, dropping: bool) -> bool:
    """Writes ``line`` unless it is (or continues) an AWS line; whether the next is dropped."""
    aws = is_aws_line(line)
    if aws is None:
        aws = dropping
    while line and not aws:
        line = line[os.write(out, line) :]
    return aws
