"""The pending marker (``_PENDING.json``, FORMAT.md): what it says, where it is found,
and whether the writer it names is gone.

A writer puts the marker first into every place it stages or is about to remove and
deletes it last (``_core.ownership``), so the remains of a save or removal that died
are proven ours by it. The marker is itself written through a temporary file
(``_PENDING.json.tmp-<hex>``, then a rename): a writer killed between the two leaves
the temporary file alone, and its content, our marker naming the dead writer, proves
the place ours just as well (:func:`read`).

A writer killed after creating the temporary file but before writing it leaves it
empty (or holding part of the marker): still a file of ours by its name, never
someone else's (:func:`temporary_files`); in a place of ours with a staging name of
ours (``<step>.deleting-<nonce>``, ``.partial-<nonce>``) that holds nothing else, it
proves the place ours (``ownership.proof``).

A place whose marker names no writer (it is gone: a removal that was cut short
between its rename and its marker, a commit between its marker's deletion and its
rename) is dead once nothing changed there for :data:`QUIET_SECONDS`
(:func:`abandoned`): a live writer holds such a place for a few system calls only.

Threading: stateless; any function may be called from any thread.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import time

from .._base import processes as _processes
from .._errors import CheckpointError, DirectoryLockedError
from .._format.layout import COMMIT_FILE, MANIFEST_FILE, PENDING_FILE
from .._storage import json_docs as _docs
from .._storage.location import Location

LIBRARY = "flax_orbax_plugin"
# The temporary file ``_storage.local_files.write_file`` writes a marker through.
TMP_RE = re.compile(rf"^{re.escape(PENDING_FILE)}\.tmp-[0-9a-f]{{1,64}}$", re.ASCII)
# A place without a marker, unchanged this long, has no live writer (module docstring).
QUIET_SECONDS = 30.0


def marker_bytes(nonce: str, keep: list[str] | tuple[str, ...] = ()) -> bytes:
    """The pending marker: ours, with the writer (host name and process id) that lets a
    later save or ``gc`` tell a save that died from one still running; ``keep``: what
    a removal leaves (entries this library did not write)."""
    doc = {"library": LIBRARY, "kind": "pending", "nonce": nonce}
    doc.update(host=socket.gethostname(), pid=os.getpid())
    if keep:
        doc["keep"] = list(keep)
    return json.dumps(doc).encode()


def is_marker(raw: bytes | None) -> bool:
    """True when ``raw`` is our pending marker (parsed within its limits)."""
    if raw is None:
        return False
    try:
        doc = _docs.parse(raw, PENDING_FILE, _docs.PENDING_MARKER)
    except CheckpointError:
        return False
    return isinstance(doc, dict) and doc.get("library") == LIBRARY and doc.get("kind") == "pending"


def keeps(raw: bytes | None) -> list[str]:
    """What a removal recorded in the pending marker ``raw`` that it leaves."""
    keep = json.loads(raw).get("keep") if is_marker(raw) else None
    return keep if isinstance(keep, list) and all(isinstance(k, str) for k in keep) else []


def nonce_of(raw: bytes | None) -> str | None:
    """The nonce a pending marker carries (its writer's save), or None."""
    nonce = json.loads(raw).get("nonce") if is_marker(raw) else None
    return nonce if isinstance(nonce, str) else None


def holds_nonce(loc: Location, nonce: str) -> bool:
    """True when ``loc``'s pending marker is the one written with ``nonce`` (this save's
    own claim), never when another writer's marker took its place."""
    try:
        return nonce_of(read(loc)) == nonce
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
    raw, generation = loc.read_versioned(PENDING_FILE, max_bytes=_docs.PENDING_MARKER.max_bytes)
    if raw is not None and nonce_of(raw) == nonce:
        return  # this save's own claim
    if raw is not None and not writer_gone(loc):
        refuse_held(loc, _words(raw))
    mine = marker_bytes(nonce)
    generation = loc.write_if(PENDING_FILE, mine, generation)
    if generation is None:  # another writer claimed between the read and the write
        refuse_held(loc, _words(read(loc)))
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
    writer = None if replace or loc.is_local else writer_of(read(loc))
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
    if not is_marker(raw):
        return None
    doc = json.loads(raw)
    host, pid = doc.get("host"), doc.get("pid")
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
        return None
    return host, pid


def temporary_files(loc: Location) -> list[str]:
    """Local only: the regular files at the top of ``loc`` named as the temporary file of
    a pending marker's write (``_PENDING.json.tmp-<hex>``) that hold our marker or the
    start of one, or nothing: a writer killed between creating one and renaming it
    leaves it empty (or, in principle, holding part of the marker). In a place proven
    ours they are ours too (``removing.strangers``); none elsewhere."""
    if not loc.is_local:
        return []
    try:
        kinds = loc.child_kinds()
    except OSError:
        return []
    names = sorted(n for n, kind in kinds.items() if kind == "file" and TMP_RE.match(n))
    return [n for n in names if _ours_cut_short(_read_quietly(loc, n))]


# How every pending marker begins (marker_bytes: json.dumps keeps the keys' order).
_HEAD = b'{"library": "flax_orbax_plugin", "kind": "pending", "nonce": "'


def _ours_cut_short(raw: bytes | None) -> bool:
    """Our marker, or what a write of one cut short holds (nothing, or its start)."""
    return raw is not None and (is_marker(raw) or _HEAD.startswith(raw) or raw.startswith(_HEAD))


def only_temporary_files(loc: Location) -> bool:
    """Local only: True when ``loc`` holds something, and nothing but
    :func:`temporary_files`: a claim or a removal killed while it wrote the marker,
    before anything else was written there or after everything else was removed."""
    try:
        kinds = loc.child_kinds() if loc.is_local else {}
    except OSError:
        return False
    return bool(kinds) and set(kinds) == set(temporary_files(loc))


def temporary_markers(loc: Location) -> list[str]:
    """Local only: the names of the temporary files at the top of ``loc`` that hold our
    pending marker (a marker's write cut short after it was written); none elsewhere."""
    return [n for n in temporary_files(loc) if is_marker(_read_quietly(loc, n))]


def read(loc: Location) -> bytes | None:
    """The pending marker of ``loc``: ``_PENDING.json``, else (local disk) the content
    of a temporary file holding our marker; None when there is neither."""
    raw = loc.read_bytes(PENDING_FILE)
    if raw is not None:
        return raw
    found = temporary_markers(loc)
    return _read_quietly(loc, found[-1]) if found else None


def _read_quietly(loc: Location, name: str) -> bytes | None:
    try:
        return loc.read_bytes(name, max_bytes=_docs.PENDING_MARKER.max_bytes)
    except (CheckpointError, OSError):
        return None  # a link, a FIFO, gone meanwhile: not our marker


def _other_writer(loc: Location) -> tuple[tuple[str, int], bool] | None:
    """The writer ``loc``'s pending marker names when it is another process of this
    host, and whether it is alive (another user's process counts as alive); None where
    that is not certain (another host, this very process, a marker naming no writer, a
    link or a FIFO where our marker would be)."""
    try:
        writer = writer_of(read(loc))
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
        if not stat.S_ISDIR(st.st_mode) or read(loc) is not None:
            return False
        names = os.listdir(path)
    except (OSError, CheckpointError):
        return False
    if names and COMMIT_FILE not in names and MANIFEST_FILE not in names:
        if not only_temporary_files(loc):  # else: as empty (a claim killed in its write)
            return False
    changed = max(st.st_ctime, loc.newest_mtime())
    return time.time() - changed > QUIET_SECONDS
