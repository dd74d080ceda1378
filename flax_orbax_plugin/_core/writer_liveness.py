"""The writer a pending marker names: whether it is alive, gone, or left a place
abandoned (``writer_gone``, ``writer_alive``, ``abandoned``, a save's dead staging:
``is_dead``); a save's own claim (``holds_nonce``); the refusals of a place another
writer holds, and the conditional claim of an object store (``claim_in_place``).
The marker itself (what it says, where it is found) is ``_core.handle``'s; a save into
a place nobody holds reads none of this module.

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

# A place without a marker, unchanged this long, has no live writer (module docstring).
QUIET_SECONDS = 30.0


def nonce_of(raw: bytes | None) -> str | None:
    """The nonce a pending marker carries (its writer's save), or None."""
    nonce = json.loads(raw).get("nonce") if _handle.is_marker(raw) else None
    return nonce if isinstance(nonce, str) else None


def holds_nonce(loc: Location, nonce: str) -> bool:
    """True when ``loc``'s pending marker is the one written with ``nonce`` (this save's
    own claim), never when another writer's marker took its place."""
    try:
        return nonce_of(_handle.read(loc)) == nonce
    except CheckpointError:
        return False


def claim_in_place(loc: Location, nonce: str, *, fresh: bool) -> None:
    """Object stores: writes the pending marker only where no other writer's marker is
    (a conditional request: two saves that start at once into the same place cannot
    both claim it; the store has no rename to stage under a name of one's own). A
    marker of a writer of this host that is gone is taken over; any other is a
    :class:`DirectoryLockedError` naming its writer, and nothing is written. With
    ``fresh`` (a save that replaces nothing), a commit record found once the claim is
    held (another save committed there meanwhile) takes the claim back and refuses."""
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
    """Before a save writes where a pending marker is: DirectoryLockedError when it names
    a live writer of this host, or (object stores, unless ``replace``) a writer of
    another host, whose life cannot be told from here: clearing the place as a dead
    save's remains would delete a live save's files (``force=True`` replaces them)."""
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


def _words(raw: bytes | None) -> str:
    writer = writer_of(raw)
    return "another writer" if writer is None else f"pid {writer[1]} on {writer[0]}"


def refuse_held(loc: Location, who: str) -> None:
    """DirectoryLockedError: ``who`` (a writer's words) holds ``loc`` under its marker."""
    raise DirectoryLockedError(
        f"cannot write at {loc}: another save or removal ({who}) is writing there "
        f"(its pending marker {PENDING_FILE}); nothing was written. Wait for it to end, "
        f"or, if it died, run `flax_orbax_plugin gc` on its directory"
    )


def writer_of(raw: bytes | None) -> tuple[str, int] | None:
    """The writer a pending marker names (host, pid), or None where it names none that
    can be trusted (an older marker, a damaged or foreign one)."""
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
    """The writer ``loc``'s pending marker names when it is another process of this
    host, and whether it is alive (another user's process counts as alive); None where
    that is not certain (another host, this very process, a marker naming no writer, a
    link or a FIFO where our marker would be)."""
    try:
        writer = writer_of(_handle.read(loc))
    except CheckpointError:
        return None
    alive = None if writer is None else _processes.alive_here(*writer)
    return None if alive is None else (writer, alive)


def writer_gone(loc: Location) -> bool:
    """True when ``loc`` carries our pending marker and the process that wrote it ran on
    this host and is no longer alive: a save (or removal) that was killed or interrupted
    before it could clean up, and that nobody is still writing. False whenever that is
    not certain (another host, this very process, a marker naming no writer)."""
    found = _other_writer(loc)
    return found is not None and not found[1]


def writer_alive(loc: Location) -> str | None:
    """The writer ``loc``'s pending marker names (``"pid N on host"``) when it is
    another live process of this host: a save still running, which nobody else may
    remove (object stores have no writer lock: a second open or ``gc`` on the same path
    would delete the staged files of its step, and the step then committed without
    them). None otherwise (dead, this process, another host, no marker naming one)."""
    found = _other_writer(loc)
    if found is None or not found[1]:
        return None
    (host, pid), _ = found
    return f"pid {pid} on {host}"


def abandoned(loc: Location) -> bool:
    """Local only: True when ``loc`` (a real directory) holds no pending marker, is
    empty or holds a commit record (``_COMMITTED``, ``_CHECKPOINT.json``), and nothing
    in it changed for :data:`QUIET_SECONDS` (the status change time of the directory
    itself counts: a rename sets it). Such a place is left by a writer killed in one of
    the short moments when nothing names it: a live one moves on within moments."""
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
    """Staging (a real directory) of a save that no longer runs: the process named in
    its pending marker is gone (this host: see :func:`writer_gone`), it names no
    writer and is unchanged for a while (:func:`abandoned`: empty, or committed, as a
    save killed between two renames leaves it), or nothing in it was touched for
    ``STALE_SECONDS`` (a writer on another host)."""
    if writer_gone(staging) or abandoned(staging):
        return True
    return time.time() - staging.newest_mtime() > STALE_SECONDS
