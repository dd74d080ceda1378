"""The ``flax-orbax`` parser and entry point: errors as one line and an exit status (1:
damage found by ``verify``, 3: an object store refused, 2: anything else); from a shell, a
stdout whose reader may go away, SIGTERM as an interruption. The standard library only
(``--help`` is instant); the commands (JAX) load after :func:`check_usage` passed and do
not check that again.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin.cli.main``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import warnings
from typing import Any

from .._errors import CheckpointError
from .._version import __version__
from .output import EXIT_ERROR, CliError, in_flag_words, one_line

_PATH = (
    "a checkpoint directory (its latest step), one step (DIR/<step>), one item "
    "(DIR/<step>/params) or a core checkpoint, on local disk, s3:// or gs://"
)
_STEP = "the step to read when PATH is a directory of steps (default: the latest)"
_JSON = "print one JSON document instead (its schema: docs/cli.md)"
_PLOT_LEAVES = "also draw the leaves by size to FILE (.png or .svg; needs matplotlib)"
_PLOT_SAVES = "also draw the steps' saves over time to FILE (.png or .svg; needs matplotlib)"
PLOT_FORMATS = {".png": "png", ".svg": "svg"}  # what --plot writes, by file name


def _positive(text: str) -> int:
    """``--keep N``/``--keep-every K`` (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, found {value}")
    return value


_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_MEMORY_HELP = (
    "the host-memory ceiling of the command, e.g. 512M, 2G (powers of 1024) or bytes "
    "(default: none); what does not fit is refused, naming the figures"
)


def _size(text: str) -> int:
    """``--memory-limit 512M``: bytes (K, M, G, T: powers of 1024, an optional iB/B)."""
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = body[-1:] if body[-1:] in _UNITS and body[-1:] else ""
    try:
        value = int(float(body[: len(body) - len(unit)]) * (1 << (10 * _UNITS[unit])))
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 512M, 2GiB or 1048576 (bytes), found {text!r}"
        )
    return value


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


_RUN = "a CheckpointManager directory (local, s3://, gs://)"
_CAST = "safe (default): a value --dtype would overflow is an error; unsafe: numpy's cast"
_SOURCE = "Orbax manager/step/item dir, msgpack file or dir, safetensors file or dir"


def _a(name: str, what: str, **keywords) -> tuple[str, dict]:
    """An argument of a command: its name and ``add_argument``'s keywords."""
    return name, {"help": what, **keywords}


def _on(name: str, what: str) -> tuple[str, dict]:
    return _a(name, what, action="store_true")


_AT_STEP = _a("--step", _STEP, type=int)
_MEMORY = _a("--memory-limit", _MEMORY_HELP, type=_size, metavar="SIZE")

# Each command: what it does, its examples, its arguments (in the order --help shows).
_COMMANDS = {
    "list": (
        "steps in a checkpoint directory: sizes, times, metrics",
        ("flax-orbax list ckpts/", "flax-orbax list gs://bucket/run1 --json"),
        _a("directory", _RUN),
        _on("--json", _JSON),
        _a("--plot", _PLOT_SAVES, metavar="FILE"),
    ),
    "inspect": (
        "leaves with shapes, dtypes, shardings and bytes",
        (
            "flax-orbax inspect ckpts/ --item params",
            "flax-orbax inspect ckpts/300 --json   (or --plot leaves.svg)",
        ),
        _a("path", _PATH),
        _AT_STEP,
        _a("--item", "only this checkpointable, e.g. params"),
        _on("--summary", "one line per item, no leaf table"),
        _on("--json", _JSON),
        _a("--plot", _PLOT_LEAVES, metavar="FILE"),
    ),
    "verify": (
        "read everything and check every checksum",
        (
            "flax-orbax verify ckpts/              (the latest step; exit 1 if damaged)",
            "flax-orbax verify s3://bucket/run1 --all",
        ),
        _a("path", _PATH),
        _AT_STEP,
        _on("--all", "every step, not only the latest"),
        _on("--json", _JSON + " (exit 1 still means damage)"),
        _MEMORY,
    ),
    "export": (
        "write params to a safetensors file",
        (
            "flax-orbax export ckpts/ model.safetensors --dtype bfloat16",
            "flax-orbax export ckpts/ out/ --max-shard-size 2GiB --transpose-kernels",
        ),
        _a("path", _PATH),
        _a("out", "the .safetensors file, or a local folder for shards + index"),
        _a("--format", "of the file written", default="safetensors", choices=["safetensors"]),
        _a("--dtype", "cast floating leaves, e.g. bfloat16"),
        _a("--cast", _CAST, default="safe", choices=["safe", "unsafe"]),
        _a("--item", "which checkpointable of a step (default: params)"),
        _AT_STEP,
        _a("--max-shard-size", "e.g. 5GB (10^9), 2GiB (2^30)", default="5GB"),
        _on("--transpose-kernels", "PyTorch kernel layout"),
        _a("--key-map", "JSON file: {leaf path: tensor name|null}"),
        _on("--force", "replace an existing export"),
        _MEMORY,
    ),
    "import": (
        "an Orbax directory, Flax msgpack file(s) or safetensors as steps",
        (
            "flax-orbax import orbax_run/ ckpts/   (or checkpoint_1000.msgpack)",
            "flax-orbax import model.safetensors ckpts/ --step 0   (or a folder of shards)",
        ),
        _a("source", _SOURCE),
        _a("out", "a CheckpointManager directory (created if missing)"),
        _a("--step", "only this step / write as this step", type=int),
        _on("--force", "replace steps that exist in OUT"),
        _a("--format-version", "of the steps written (default 2)", type=int, choices=(1, 2)),
        _MEMORY,
    ),
    "gc": (
        "apply retention and remove unfinished steps",
        (
            "flax-orbax gc ckpts/                  (only unfinished steps are removed)",
            "flax-orbax gc ckpts/ --keep 3 --keep-every 1000 --dry-run",
        ),
        _a("directory", _RUN),
        _a("--keep", "keep the last N steps", type=_positive),
        _a("--keep-every", "and every step divisible by K", type=_positive),
        _on("--dry-run", "name what would be removed; remove nothing"),
        _on("--json", _JSON),
    ),
}


class _Parser(argparse.ArgumentParser):
    """An argument a command does not take is that command's error, with its usage."""

    commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extra = self.parse_known_args(argv, namespace)
        if not extra:
            return parsed
        unknown = f"unrecognized arguments: {' '.join(extra)}"
        name = parsed.command
        if any(x in argv[: argv.index(name)] for x in extra):  # given before the command
            self.error(f"{unknown} (a command's options go after it: flax-orbax {name} ...)")
        self.commands[name].error(unknown)


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog="flax-orbax",
        description="Inspect, verify, export and clean flax_orbax_plugin checkpoints.",
        epilog=_examples(
            "flax-orbax list ckpts/",
            "flax-orbax verify s3://bucket/run1 --all",
            "flax-orbax COMMAND --help     (the options and examples of one command)",
        ),
        formatter_class=raw,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p.commands = sub.choices
    for name, (what, examples, *arguments) in _COMMANDS.items():
        description = what[0].upper() + what[1:] + "."
        s = sub.add_parser(
            name,
            help=what,
            description=description,
            epilog=_examples(*examples),
            formatter_class=raw,
        )
        for argument, keywords in arguments:
            s.add_argument(argument, **keywords)
    return p


def check_usage(args: argparse.Namespace) -> None:
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


def main(argv: list[str] | None = None) -> int:
    # A shell's command: signals taken before anything else.
    interrupts = install_signals() if argv is None else None
    if argv is None:
        open_standard_streams()
    args = build_parser().parse_args(argv)
    if interrupts is not None:
        install(interrupts, args.command)
    try:
        status = _run(args, interrupts)
    except KeyboardInterrupt as e:
        if interrupts is not None:
            interrupts.stopped()  # a second signal now changes nothing
        terminated = isinstance(e, Terminated)
        how = "terminated" if terminated else "interrupted"
        print(f"flax-orbax {args.command}: {how}{_done(e)}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    # a signal the command could not act on: 130 or 143, said so
    return status if interrupts is None else interrupts.finish(status)


def _run(args: argparse.Namespace, interrupts: Interrupts | None) -> int:
    """The command's exit status; errors as one line (a KeyboardInterrupt propagates)."""
    try:
        check_usage(args)  # said before the command loads (JAX, seconds)
        # Inside the function on purpose: --help and --version must not load JAX.
        from . import dispatch

        command = dispatch.command(args.command)  # signals held while it loads
        if interrupts is not None:
            interrupts.loaded()
        return dispatch.run(args, command, in_process=interrupts is None)
    except CliError as e:
        print(f"flax-orbax {args.command}: error: {in_flag_words(str(e))}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_ERROR)
    except Exception as e:
        kind = "" if isinstance(e, (CheckpointError, OSError)) else f"{type(e).__name__}: "
        line = f"{kind}{in_flag_words(one_line(e))}{_done(e, flat=True)}"
        print(f"flax-orbax {args.command}: error: {line}", file=sys.stderr)
        if os.environ.get("FLAX_ORBAX_DEBUG"):
            raise
        return EXIT_ERROR


def _done(e: BaseException, *, flat: bool = False) -> str:
    """`` (...)``: what the command had done before ``e`` (its notes), "" if nothing."""
    done = "; ".join(getattr(e, "__notes__", ()))
    return f" ({' '.join(done.split()) if flat else done})" if done else ""


EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is (its cleanups run as for Ctrl-C)."""


class _PipeSafe:
    """``stream`` whose writes, once its reader has gone (EPIPE), go nowhere."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.broken = True
        devnull = os.open(os.devnull, os.O_WRONLY)  # the buffered rest, flushed at exit
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Interrupts:
    """Ctrl-C and SIGTERM for a shell's command: one line, and 130 or 143. Held back while
    the commands load (an interrupted JAX import aborts), then raised where the command
    is; during an interruption's clean-up only noted; after :meth:`finish`, too late.

    Main thread; call order: :meth:`loaded`, then :meth:`stopped` or :meth:`finish`.
    """

    def __init__(self) -> None:
        self.command = ""
        self.signum: int | None = None  # the first signal: the one the command reports
        self._state = "loading"  # then "running", and "stopped" or "finished"

    def handler(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if self._state == "finished":
            self._exit_too_late()
        elif self._state == "running" and not _handling_interruption():
            _raise(signum)

    def loaded(self) -> None:
        """The commands are loaded: a signal held back is raised now, later ones at once."""
        self._state = "running"
        if self.signum is not None:
            _raise(self.signum)

    def stopped(self) -> None:
        """Later signals ignored (after finalization a default handler would kill us)."""
        self._state = "stopped"
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def finish(self, status: int) -> int:
        """``status``, or 130 / 143 where a signal came too late to stop the command."""
        if self._state == "stopped":
            return status
        self._state = "finished"
        return status if self.signum is None else self._too_late()

    def _too_late(self) -> int:
        """Stops (:meth:`stopped`), says the signal came too late; its exit status."""
        self.stopped()
        terminated = self.signum == signal.SIGTERM
        what = "terminated" if terminated else "interrupted"
        print(
            f"flax-orbax {self.command}: {what}, too late to stop it: the command had "
            f"finished (what it wrote is complete)",
            file=sys.stderr,
        )
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED

    def _exit_too_late(self) -> None:
        code = self._too_late()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)  # the work is done and its output flushed: nothing left to run


def _raise(signum: int) -> None:
    if signum == signal.SIGTERM:
        raise Terminated(f"terminated (signal {int(signal.SIGTERM)})")
    raise KeyboardInterrupt


def _handling_interruption() -> bool:
    """True while the main thread handles a KeyboardInterrupt: a clean-up under way."""
    exc = sys.exc_info()[1]
    for _ in range(64):  # an exception raised during the clean-up: its context
        if exc is None:
            return False
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__context__
    return False


def open_standard_streams() -> None:
    """Descriptors 0, 1, 2 the shell left closed (``>&-``) opened on ``/dev/null``: else a
    log line went into the first file the command opened."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    # on a /dev/null of their own: descriptors 1 and 2 may hold another file
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")


def install_signals() -> Interrupts:
    """Ctrl-C and SIGTERM as :class:`Interrupts` says; one ignored at start (``cmd &``) stays so."""
    interrupts = Interrupts()
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, interrupts.handler)
    return interrupts


def install(interrupts: Interrupts, command: str) -> None:
    """Once parsed: stdout safe from a closed pipe, warnings as the command's lines."""
    interrupts.command = command
    sys.stdout = _PipeSafe(sys.stdout)  # type: ignore[assignment]

    def show(message: Any, category: Any, *_: Any, **__: Any) -> None:
        print(f"flax-orbax {command}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
