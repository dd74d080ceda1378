"""The writer a pending marker names (alive, gone, or the place abandoned), and the
claims and refusals that follow from it. The marker itself is ``_core.handle``'s.

Threading: stateless; any function may be called from any thread.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time

from .._base import processes as _processes
from .._errors import CheckpointError, DirectoryLockedError
from .._format.layout import COMMIT_FILE, MANIFEST_FILE, PENDING_FILE
from .._storage import local_files as _local_files
from .._storage.location import Location
from . import handle as _handle

QUIET_SECONDS = 30.0  # a place without a marker, unchanged this long: no live writer


def nonce_of(raw: bytes | None) -> str | None:
    nonce = json.loads(raw).get("nonce") if _handle.is_marker(raw) else None
    return nonce if isinstance(nonce, str) else None


def holds_nonce(loc: Location, nonce: str) -> bool:
    try:
        return nonce_of(_handle.read(loc)) == nonce
    except CheckpointError:
        return False


def claim_in_place(loc: Location, nonce: str, *, fresh: bool) -> None:
    """Object stores: the pending marker written only where no live writer's is."""
    raw, generation = loc.read_versioned(
        PENDING_FILE, max_bytes=_local_files.PENDING_MARKER.max_bytes
    )
    if raw is not None and nonce_of(raw) == nonce:
        return  # this save's own claim
    if raw is not None and not writer_gone(loc):
        refuse_held(loc, _words(raw))
    mine = _handle.marker_bytes(nonce)
    generation = loc.write_if(PENDING_FILE, mine, generation)
    if generation is None:  # another writer claimed between the read and the write
        refuse_held(loc, _words(_handle.read(loc)))
    if fresh and any(loc.exists(name) for name in (COMMIT_FILE, MANIFEST_FILE)):
        loc.write_if(PENDING_FILE, None, generation)  # our marker only, never theirs
        raise CheckpointError(
            f"cannot write at {loc}: another save committed a checkpoint there while "
            f"this one started; nothing was written and it is left as it is"
        )


def refuse_if_held(loc: Location, *, replace: bool) -> None:
    """DirectoryLockedError when ``loc``'s marker names a live (or another host's) writer."""
    alive = writer_alive(loc)
    if alive is not None:
        refuse_held(loc, alive)
    writer = None if replace or loc.is_local else writer_of(_handle.read(loc))
    if writer is not None and writer[0] != socket.gethostname():
        refuse_held(
            loc,
            f"pid {writer[1]} on {writer[0]}, another host: if that save died, save with "
            f"force=True to replace what it left",
        )


def _words(raw: bytes | None) -> str:  # the marker's writer in words
    writer = writer_of(raw)
    return "another writer" if writer is None else f"pid {writer[1]} on {writer[0]}"


def refuse_held(loc: Location, who: str) -> None:
    """DirectoryLockedError: ``who`` (a writer's words) holds ``loc`` under its marker."""
    raise DirectoryLockedError(
        f"cannot write at {loc}: another save or removal ({who}) holds it ({PENDING_FILE}); "
        f"nothing was written. Wait for it to end, or if it died run `flax_orbax_plugin gc`"
    )


def writer_of(raw: bytes | None) -> tuple[str, int] | None:
    """The writer a pending marker names (host, pid), or None where none is trusted."""
    if not _handle.is_marker(raw):
        return None
    doc = json.loads(raw)
    host, pid = doc.get("host"), doc.get("pid")
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
        return None
    return host, pid


def _other_writer(loc: Location) -> tuple[tuple[str, int], bool] | None:
    """(another process of this host that ``loc``'s marker names, alive), else None."""
    try:
        writer = writer_of(_handle.read(loc))
    except CheckpointError:
        return None
    alive = None if writer is None else _processes.alive_here(*writer)
    return None if alive is None else (writer, alive)


def writer_gone(loc: Location) -> bool:
    """``loc``'s marker names a process of this host that is gone (False if not certain)."""
    found = _other_writer(loc)
    return found is not None and not found[1]


def writer_alive(loc: Location) -> str | None:
    """``"pid N on host"`` when ``loc``'s marker names another live process of this host."""
    found = _other_writer(loc)
    if found is None or not found[1]:
        return None
    (host, pid), _ = found
    return f"pid {pid} on {host}"


def abandoned(loc: Location) -> bool:
    """Local only: no marker, empty or committed, and unchanged for :data:`QUIET_SECONDS`."""
    if not loc.is_local:
        return False
    path = loc.path.rstrip("/")
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or _handle.read(loc) is not None:
            return False
        names = os.listdir(path)
    except (OSError, CheckpointError):
        return False
    if names and COMMIT_FILE not in names and MANIFEST_FILE not in names:
        if not _handle.only_temporary_files(loc):  # else: as empty (a claim killed in its write)
            return False
    changed = max(st.st_ctime, loc.newest_mtime())
    return time.time() - changed > QUIET_SECONDS


STALE_SECONDS = 3600.0  # a staging directory untouched this long belongs to a dead save


def is_dead(staging: Location) -> bool:
    """:func:`writer_gone`, :func:`abandoned`, or untouched for ``STALE_SECONDS``."""
    if writer_gone(staging) or abandoned(staging):
        return True
    return time.time() - staging.newest_mtime() > STALE_SECONDS
