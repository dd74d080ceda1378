"""The remains of an export that died: named by a marker, removed by the next export to
its folder or by ``flax-orbax gc``. Stateless; local disk only.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._interop.safetensors.remains``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import stat

from ..._base import processes as _processes
from ..._errors import CheckpointError
from ..._storage.untrusted import loads_json, read_capped

LIBRARY = "flax_orbax_plugin"
MARKER_RE = re.compile(r"^\.flax-orbax-export-([0-9a-f]{16})\.pending$", re.ASCII)
_MAX_MARKER_BYTES = 4096
_log = logging.getLogger(__package__)


def marker_name(nonce: str) -> str:
    return f".flax-orbax-export-{nonce}.pending"


def temp_name(final_name: str, nonce: str) -> str:
    """The temporary name of ``final_name`` for the export whose marker has ``nonce``."""
    return f".{final_name}.tmp-{nonce}"


def begin(directory: str) -> str:
    """Writes a new export's marker in ``directory`` (exclusively); returns its nonce."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        nonce = secrets.token_hex(8)
        try:
            fd = os.open(os.path.join(directory, marker_name(nonce)), flags, 0o644)
        except FileExistsError:
            continue  # vanishingly unlikely: draw another
        doc = {"library": LIBRARY, "kind": "export", "nonce": nonce}
        doc.update(host=socket.gethostname(), pid=os.getpid())
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(doc).encode())
        return nonce
    raise FileExistsError(f"{directory}: could not create the export's marker")


def end(directory: str, nonce: str) -> None:
    """Removes the export's marker: its files are in place, or removed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, marker_name(nonce)))


def _writer_gone(path: str, nonce: str) -> bool:
    """True when ``path`` is our marker for ``nonce`` of a gone process of this host."""
    try:
        doc = loads_json(
            read_capped(path, follow_links=False, what="marker", max_bytes=_MAX_MARKER_BYTES), path
        )
    except (CheckpointError, OSError):
        return False
    if not isinstance(doc, dict) or (doc.get("library"), doc.get("kind")) != (LIBRARY, "export"):
        return False
    if doc.get("nonce") != nonce:
        return False
    return _processes.alive_here(doc.get("host"), doc.get("pid")) is False


def dead(directory: str) -> list[str]:
    """What exports that died left in ``directory``: each one's files, then its marker."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found: list[str] = []
    for marker in sorted(n for n in names if MARKER_RE.match(n)):
        nonce = MARKER_RE.match(marker).group(1)
        if not _writer_gone(os.path.join(directory, marker), nonce):
            continue
        suffix = f".tmp-{nonce}"
        temps = [n for n in names if n.startswith(".") and n.endswith(suffix) and n != suffix]
        found += [n for n in sorted(temps) if _regular(os.path.join(directory, n))] + [marker]
    return found


def remove_dead(directory: str) -> list[str]:
    """Removes what :func:`dead` names (a failure is logged); returns the names removed."""
    removed = []
    for name in dead(directory):
        try:
            os.unlink(os.path.join(directory, name))  # the name: a link is not followed
        except FileNotFoundError:
            continue
        except OSError as e:
            _log.warning("%s: the remains of an export that died, not removed: %s", name, e)
            continue
        removed.append(name)
    if removed:
        _log.info("%s: removed the remains of an export that died: %s", directory, removed)
    return removed


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
