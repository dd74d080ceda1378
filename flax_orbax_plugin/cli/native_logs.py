"""Keeps the AWS C libraries' log lines off the terminal while a command talks to S3
(``FLAX_ORBAX_DEBUG=1``: not). Not reentrant; one command at a time per process.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin.cli.native_logs``.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

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
    """Writes ``line`` unless it is (or continues) an AWS line; returns whether the
    next continuation line is dropped."""
    aws = is_aws_line(line)
    if aws is None:
        aws = dropping
    while line and not aws:
        line = line[os.write(out, line) :]
    return aws
