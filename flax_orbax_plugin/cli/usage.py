"""A command's usage errors that its arguments alone show, said before the command
loads (JAX: seconds). The standard library only; ``main`` checks every command here
before ``dispatch`` runs it, so the commands do not check these again.
"""

from __future__ import annotations

import argparse
import os

from .output import CliError

PLOT_FORMATS = {".png": "png", ".svg": "svg"}  # what --plot writes, by file name


def check(args: argparse.Namespace) -> None:
    """CliError for the first usage error ``args`` (parsed) shows by itself."""
    name = args.command
    if name == "verify" and args.step is not None and args.all:
        raise CliError(f"--step {args.step} and --all: choose one (--all checks every step)")
    plot = getattr(args, "plot", None)
    if plot and os.path.splitext(plot)[1].lower() not in PLOT_FORMATS:
        raise CliError(f"--plot {plot!r}: expected a file name ending in .png or .svg")
    if name == "export" and args.dtype is None and args.cast != "safe":
        raise CliError(f"--cast {args.cast} does nothing without --dtype (no leaf is cast)")
    if name == "gc" and args.keep_every is not None and args.keep is None:
        raise CliError(f"--keep-every {args.keep_every} does nothing without --keep N")
