"""Every process sees one directory: checked when a writer opens a local path.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.shared_dir``.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat

from .._base import distributed as _distributed
from .._errors import CheckpointError
from .location import Location

PREFIX = ".fop-visible-"
_MAX = 256  # bytes read back: the nonce is 32


def check_visible(loc: Location, region: _distributed.Region, *, per_host_ok: bool = False) -> bool:
    """Raises CheckpointError on every process when some process does not see what the
    primary wrote in ``loc``. Every process calls it, in the manager open's ``region``.
    With ``per_host_ok`` (a persistent tier), a directory per host is accepted: True
    then, on every process; a mix is refused."""
    if _distributed.process_count() == 1 or not loc.is_local:
        return False
    if per_host_ok:
        return _per_host(loc, region)
    directory = loc.path.rstrip("/")
    op = region.next_operation_id("visible")
    created, shared = _create(directory) if _distributed.is_primary() else (None, None)
    try:
        sent = json.loads(region.broadcast_str(f"{op}/file", shared))
        if "error" in sent:
            raise CheckpointError(
                f"{loc}: process 0 could not create the file that shows every process "
                f"sees this directory: {sent['error']}"
            )
        if not _distributed.is_primary():
            seen = _read(directory, sent["name"], sent["nonce"].encode())
            report = json.dumps({"host": socket.gethostname(), "seen": seen})
            region.publish(f"{op}/report", report)
            verdict = region.broadcast_str(f"{op}/verdict", None)
        else:
            reports = [None] + [
                json.loads(region.get_from(f"{op}/report", p))
                for p in range(1, _distributed.process_count())
            ]
            verdict = _verdict(loc, sent["host"], reports)
            region.broadcast_str(f"{op}/verdict", verdict)
    finally:
        if created is not None:
            _remove(directory, *created)
    region.forget(f"{op}/report")
    if verdict:
        raise CheckpointError(verdict)
    return False


def _per_host(loc: Location, region: _distributed.Region) -> bool:
    """Every process writes a file of its own and looks for every other's: all seen, one
    shared directory (False); none, a directory per host (True); else CheckpointError."""
    directory = loc.path.rstrip("/")
    op = region.next_operation_id("visible")
    me, count = _distributed.process_index(), _distributed.process_count()
    created, mine = _create(directory)
    try:
        region.publish(f"{op}/file", mine)
        files = [json.loads(v) for v in region.gather_str(f"{op}/file")]
        seen = [
            "yes" if p == me else _read(directory, f["name"], f["nonce"].encode())
            for p, f in enumerate(files)
            if "error" not in f
        ]
        region.publish(f"{op}/seen", json.dumps(seen))
        views = [json.loads(v) for v in region.gather_str(f"{op}/seen")]
    finally:
        if created is not None:
            _remove(directory, *created)
    failed = [f"process {p}: {f['error']}" for p, f in enumerate(files) if "error" in f]
    if failed:
        raise CheckpointError(
            f"{loc}: not every process could create the file that shows who sees this "
            f"directory: " + "; ".join(failed)
        )
    yes = sum(v == "yes" for view in views for v in view)
    if yes == count * count:
        return False
    if yes == count:
        return True
    hosts = ", ".join(f"process {p} on {f['host']!r}" for p, f in enumerate(files))
    raise CheckpointError(
        f"{loc}: some processes share this directory and others do not ({hosts}; "
        f"{yes - count} of {count * (count - 1)} cross checks saw the other's file). Give "
        f"every process either one directory every host mounts, or one only it sees"
    )


def _create(directory: str) -> tuple[tuple[str, tuple[int, int]] | None, str]:
    """Creates a file of a fresh name and nonce in ``directory``, exclusively: its name
    and (device, inode), and the JSON every process is told (or the error, if none)."""
    name, nonce = f"{PREFIX}{secrets.token_hex(8)}", secrets.token_hex(16)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
            try:
                os.write(fd, nonce.encode())
                st = os.fstat(fd)
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)
    except OSError as e:  # every process learns of it (none waits for a file)
        return None, json.dumps({"error": f"{type(e).__name__}: {e}"})
    shown = {"name": name, "nonce": nonce, "host": socket.gethostname()}
    return (name, (st.st_dev, st.st_ino)), json.dumps(shown)


def _read(directory: str, name: str, nonce: bytes) -> str:
    """``"yes"`` when ``directory/name`` is a regular file holding ``nonce``, else what
    was found instead."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "the directory does not exist there"
    except OSError as e:
        return f"the directory cannot be opened there ({e.strerror})"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return "the file is missing there"
    except OSError as e:
        return f"the file cannot be opened there ({e.strerror})"
    finally:
        os.close(dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "another kind of file is there under its name"
        raw = os.read(fd, _MAX)
    finally:
        os.close(fd)
    return "yes" if raw == nonce else "another file is there under its name"


def _remove(directory: str, name: str, identity: tuple[int, int]) -> None:
    """Unlinks ``directory/name`` only while it is still the file :func:`_create` made
    (same device and inode, no link followed); errors are left alone (a few bytes)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == identity:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _verdict(loc: Location, primary_host: str, reports: list) -> str:
    """``""`` when every process saw the file, else the error every process raises."""
    blind = [(p, r) for p, r in enumerate(reports) if r is not None and r["seen"] != "yes"]
    if not blind:
        return ""
    who = "; ".join(f"process {p} on host {r['host']!r}: {r['seen']}" for p, r in blind)
    return (
        f"{loc}: not every process sees the same directory: process 0 (host "
        f"{primary_host!r}) wrote a file there that {len(blind)} of {len(reports) - 1} "
        f"other process(es) cannot read ({who}). Use a filesystem every host mounts or an "
        f"object store; per-host local directories need a persistent tier (persistent=...)"
    )
