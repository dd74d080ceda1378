"""JSON documents on storage (limits per kind, checked parse and encode), and local files
under a location, never following a link below it.

Pure functions of bytes and paths, no state: safe from any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.local_files``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import errno
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from .._base import env as _env
from .._errors import CorruptCheckpointError, ForeignEntryError, StructureError
from .untrusted import entry_kind, field_before, unencodable


@dataclasses.dataclass(frozen=True)
class DocKind:
    """The limits of one kind of document: ``what`` names it in messages."""

    what: str
    max_bytes: int
    max_depth: int
    unique_keys: bool = True  # an object listing a key twice is damage


# The one declaration of the reader's limits (FORMAT.md, "Limits"). The metadata lets a
# repeated key pass the parser (~60% of its parse time); its records are checked after.
METADATA = DocKind("metadata document (_METADATA.json)", 64 << 20, 64, unique_keys=False)
DATA_INDEX = DocKind("data index (data/<p>.json)", 64 << 20, 8)
STEP_MANIFEST = DocKind("step manifest (_CHECKPOINT.json)", 64 << 20, 8)
COMMIT_MARKER = DocKind("commit marker (_COMMITTED)", 64 << 20, 8)  # one entry per process
PENDING_MARKER = DocKind("pending marker (_PENDING.json)", 1 << 16, 4)  # + what it keeps
HOST_MARKER = DocKind("per-host marker (_HOST.json)", 1 << 20, 8)
RUN_RECORD = DocKind("run record (_RUN.json)", 4096, 4)
TIER_RECORD = DocKind("record of damaged steps (_DAMAGED.json)", 16 << 20, 8)
JSON_ITEM = DocKind("JSON item (extras, iterator state, value.json)", 64 << 20, 100)
# The most any small file of this library holds (a read of one is capped at this).
MAX_DOCUMENT_BYTES = max(
    k.max_bytes for k in (METADATA, DATA_INDEX, STEP_MANIFEST, COMMIT_MARKER, JSON_ITEM)
)

# The latest time a record may carry: a day before datetime's end (a date in every zone).
MAX_TIME = float(datetime.datetime(9999, 12, 30, tzinfo=datetime.UTC).timestamp())

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_QUOTE, _OPEN, _CLOSE = ord('"'), ord("{"), ord("}")  # '[' | 32 == '{', ']' | 32 == '}'


def depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw``, without parsing."""
    if b"\\" in raw:
        raw = _ESCAPE.sub(b"", raw)  # then every '"' opens or closes a string
    a = np.frombuffer(raw, np.uint8)
    folded = a | 32
    at = np.flatnonzero((folded == _OPEN) | (folded == _CLOSE))
    if not at.size:
        return 0
    inside = np.bitwise_xor.accumulate(a == _QUOTE)
    at = at[~inside[at]]
    steps = np.where(folded[at] == _OPEN, np.int32(1), np.int32(-1))
    return int(np.cumsum(steps).max(initial=0))


class _Repeated(ValueError):
    """A key an object lists twice (``args[0]``)."""


def _unique(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise _Repeated(key)
            seen.add(key)
    return out


class _NonFinite(ValueError):
    """A number JSON may not hold (``args[0]``: its text)."""


def _finite(text: str) -> float:
    value = float(text)  # 1e999 overflows to infinity: refused like Infinity
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


def parse(raw: bytes, where: str, kind: DocKind) -> Any:
    """The JSON value of ``raw``, a document of ``kind`` read from storage;
    CorruptCheckpointError naming ``where`` when it is larger or deeper than ``kind``
    allows, not UTF-8 JSON, or holds a non-finite number, a lone surrogate or a repeated key."""
    if len(raw) > kind.max_bytes:
        raise CorruptCheckpointError(
            f"{where}: {len(raw)} bytes, more than a {kind.what} may hold ({kind.max_bytes})"
        )
    found = depth(raw)
    if found > kind.max_depth:
        raise CorruptCheckpointError(
            f"{where}: nested {found} levels deep, more than a {kind.what} may be "
            f"({kind.max_depth})"
        )
    hook = _unique if kind.unique_keys else None
    try:
        value = json.loads(
            raw.decode("utf-8"),
            parse_constant=_finite,  # NaN, Infinity, -Infinity: refused
            parse_float=_finite,
            object_pairs_hook=hook,
        )
    except _Repeated as e:
        raise CorruptCheckpointError(
            f"malformed {where}: field {e.args[0][:80]!r}: expected once in its object, found twice"
        ) from None
    except _NonFinite as e:
        raise CorruptCheckpointError(
            f"malformed {where}: field {field_before(raw, e.args[0])}: expected a finite "
            f"number, found {e.args[0][:40]}"
        ) from None
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        text = str(e)
        text = text if len(text) <= 200 else text[:197] + "..."
        raise CorruptCheckpointError(f"{where} is not valid JSON: {text}") from None
    if b"\\ud" in raw or b"\\uD" in raw:  # a surrogate escaped: a pair, or a lone one
        bad = unencodable(value)
        if bad is not None:
            raise CorruptCheckpointError(
                f"malformed {where}: {bad[0]}: expected UTF-8 text, found a lone "
                f"surrogate in {bad[1]!r}"
            )
    return value


def encode(value: Any, where: str, kind: DocKind, **dumps: Any) -> bytes:
    """The JSON bytes (compact unless ``dumps`` says) of ``value``, a document of ``kind``
    for ``where``; StructureError naming ``where`` for anything :func:`parse` would refuse."""
    dumps.setdefault("separators", (",", ":"))
    try:
        text = json.dumps(value, allow_nan=False, **dumps)
    except RecursionError:
        raise StructureError(
            f"{where}: nested too deeply for a {kind.what} (at most {kind.max_depth} levels)"
        ) from None
    except (ValueError, TypeError) as e:  # NaN or infinity; a value JSON has no type for
        raise StructureError(f"{where}: cannot be stored as a {kind.what}: {e}") from None
    if "\\ud" in text:  # a surrogate escaped: a pair (fine), or a lone one (refused)
        bad = unencodable(value)
        if bad is not None:
            raise StructureError(
                f"{where}: {bad[0]} holds text that cannot be encoded as UTF-8 (a lone "
                f"surrogate: {bad[1]!r}); a reader would refuse it"
            )
    raw = text.encode("utf-8")
    if len(raw) > kind.max_bytes:
        raise StructureError(
            f"{where}: a {kind.what} of {len(raw)} bytes, more than a reader accepts "
            f"({kind.max_bytes}); nothing was committed"
        )
    found = depth(raw)
    if found > kind.max_depth:
        raise StructureError(
            f"{where}: nested {found} levels deep, more than a reader accepts in a "
            f"{kind.what} ({kind.max_depth})"
        )
    return raw


def check_time(value: Any, where: str, field: str, *, stored: bool) -> float:
    """``value`` as seconds since the epoch in [0, :data:`MAX_TIME`]; else, for a record
    read back (``stored``), CorruptCheckpointError naming ``where`` and ``field``, or ValueError."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and 0 <= value <= MAX_TIME:
        return float(value)
    message = (
        f"{where}: field {field}: expected a time in seconds since the epoch up to "
        f"{MAX_TIME:.0f} (year 9999), found {str(value)[:40]}"
    )
    raise CorruptCheckpointError(message) if stored else ValueError(message)


def walk_entries(top: str):
    """Every non-directory entry under the local directory ``top``, walked without
    following a link or opening a file; nothing when ``top`` is missing."""
    stack = [top]
    while stack:
        where = stack.pop()
        try:
            it = os.scandir(where)
        except (FileNotFoundError, NotADirectoryError):
            continue
        with it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    yield entry


def require_regular(st: os.stat_result, path: str, *, allow_dir: bool = False) -> None:
    if stat.S_ISREG(st.st_mode) or (allow_dir and stat.S_ISDIR(st.st_mode)):
        return
    raise ForeignEntryError(
        f"{path}: expected a regular file written by this library, found {entry_kind(st.st_mode)} "
        "(never followed or read)"
    )


def check_size(size: int, path: str, max_bytes: int | None = MAX_DOCUMENT_BYTES) -> None:
    if max_bytes is not None and size > max_bytes:
        raise CorruptCheckpointError(
            f"{path}: expected a small file of at most {max_bytes} bytes, found {size} bytes"
        )


def open_dirs(root: str, parts: list[str], *, create: bool = False) -> int:
    """An fd of ``root/parts...``, each part opened with ``O_NOFOLLOW`` (created first with
    ``create``); ForeignEntryError for a link or non-directory on the way."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walked = root.rstrip("/")
        for part in parts:
            walked += "/" + part
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                sub = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):  # named by its whole path
                    raise type(e)(e.errno, e.strerror, walked) from None
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                raise ForeignEntryError(
                    f"{walked}: expected a directory written by this library, found "
                    f"{entry_kind(st.st_mode)} (never followed)"
                ) from None
            os.close(fd)
            fd = sub
        return fd
    except BaseException:
        os.close(fd)
        raise


def _in_parent(root: str, name: str, use: Callable[[int, str], Any]) -> Any:
    """``use(fd of the directory holding root/name, its last part)``, the directories on
    the way opened as :func:`open_dirs` does; None when one of them or the entry
    (``FileNotFoundError`` from ``use``) is missing."""
    parts = name.split("/")
    try:
        dfd = open_dirs(root, parts[:-1])
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return use(dfd, parts[-1])
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)


def _open_regular(root: str, name: str) -> tuple[int, os.stat_result] | None:
    """An fd of the regular file ``root/name`` (no link, no FIFO waited on) and its
    stat; None when it does not exist."""
    path = os.path.join(root, name)

    def open_in(dfd: int, last: str) -> int:
        try:  # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
            return os.open(
                last, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
        except OSError as e:
            if e.errno == errno.ELOOP:
                require_regular(os.stat(last, dir_fd=dfd, follow_symlinks=False), path)
            raise type(e)(e.errno, e.strerror, path) from None  # named by its whole path

    if (fd := _in_parent(root, name, open_in)) is None:
        return None
    try:
        st = os.fstat(fd)
        require_regular(st, path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file(root: str, name: str, max_bytes: int | None) -> bytes | None:
    opened = _open_regular(root, name)
    if opened is None:
        return None
    fd, st = opened
    path, chunks, total = os.path.join(root, name), [], 0
    try:
        while True:  # the file may grow after fstat: read at most the cap (+1 to notice)
            check_size(max(st.st_size, total), path, max_bytes)
            want = 1 << 24 if max_bytes is None else min(1 << 24, max_bytes + 1 - total)
            if not (chunk := os.read(fd, want)):
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)


def read_pieces(root: str, name: str, piece: int) -> Iterator[bytes] | None:
    """The file ``root/name`` as pieces of at most ``piece`` bytes read as taken (closed
    when the generator ends or is closed); None when it does not exist."""
    opened = _open_regular(root, name)
    if opened is None:
        return None
    fd = opened[0]

    def pieces() -> Iterator[bytes]:
        try:
            while chunk := os.read(fd, piece):
                yield chunk
        finally:
            os.close(fd)

    return pieces()


def write_file(
    root: str, name: str, data: bytes | Iterable[bytes], *, durable: bool = True
) -> None:
    """Writes ``root/name`` whole (a temporary name, then a rename), never through a
    link; an OSError names the file. ``data``: the bytes, or pieces."""
    _env.fail_point("write_small")
    try:
        _write_file(root, name, data, durable=durable)
    except OSError as e:
        if e.errno is None:
            raise
        where = os.path.join(root, name)
        text = f"writing {where} failed: {e.strerror}"
        other = e.filename if isinstance(e.filename, str) and os.path.isabs(e.filename) else None
        if other is None or other == where:
            raise OSError(e.errno, text) from e
        raise OSError(e.errno, text, other) from e  # where on the way it failed


def make_dirs(root: str) -> None:
    """``os.makedirs(root, exist_ok=True)``; a non-directory on the way: ForeignEntryError."""
    try:
        os.makedirs(root, exist_ok=True)
    except (NotADirectoryError, FileExistsError):
        walked = os.path.abspath(root)
        while not os.path.lexists(walked) or os.path.isdir(walked):
            parent = os.path.dirname(walked)
            if parent == walked:
                raise
            walked = parent
        st = os.stat(walked, follow_symlinks=False)
        raise ForeignEntryError(
            f"cannot create the directory {os.path.abspath(root)}: {walked} is "
            f"{entry_kind(st.st_mode)}, not a directory; it is left alone. Choose another path"
        ) from None


def _write_file(root: str, name: str, data: bytes | Iterable[bytes], *, durable: bool) -> None:
    parts = name.split("/")
    make_dirs(root)
    dfd = open_dirs(root, parts[:-1], create=True)
    try:
        # unpredictable, created exclusively: O_EXCL refuses a link there (EEXIST)
        tmp = f"{parts[-1]}.tmp-{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=dfd)
        try:
            try:
                for piece in (data,) if isinstance(data, (bytes, bytearray, memoryview)) else data:
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(fd, view) :]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a link itself
        except BaseException:
            try:  # ENOSPC, EIO ...: no half-written temporary file stays behind
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)


def delete_file(root: str, name: str) -> None:
    """Unlinks ``root/name`` (a symlink itself, never its target); no error if absent."""
    _in_parent(root, name, lambda dfd, last: os.unlink(last, dir_fd=dfd))


def exists(root: str, name: str) -> bool:
    """True for a regular file or directory at ``root/name``; ForeignEntryError for a
    link or special file there or on the way."""
    st = _in_parent(root, name, lambda dfd, last: os.stat(last, dir_fd=dfd, follow_symlinks=False))
    if st is None:
        return False
    require_regular(st, os.path.join(root, name), allow_dir=True)
    return True


def child_kinds(path: str) -> dict[str, str]:
    """``{name: "dir" | "file" | "symlink" | "other"}`` of the immediate children."""
    try:
        with os.scandir(path) as it:
            entries = sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {e.name: _kind(e) for e in entries}


def _kind(e: os.DirEntry) -> str:
    if e.is_symlink():
        return "symlink"
    if e.is_dir(follow_symlinks=False):
        return "dir"
    return "file" if e.is_file(follow_symlinks=False) else "other"


def exchange(a_path: str, b_path: str) -> bool:
    """Atomically swaps two directories (``renameat2(RENAME_EXCHANGE)``), then fsyncs
    ``b_path``'s parent; False where the kernel or filesystem cannot."""
    renameat2, at_fdcwd, rename_exchange = _libc("renameat2"), -100, 2
    a, b = a_path.encode(), b_path.encode()
    if renameat2 is None or renameat2(at_fdcwd, a, at_fdcwd, b, rename_exchange) != 0:
        return False
    fsync_dir(os.path.dirname(b_path))
    return True


def sync_tree(path: str) -> None:
    """Makes everything under the directory ``path`` durable: one ``syncfs``, else an
    fsync of every file (links skipped) and directory."""
    if (syncfs := _libc("syncfs")) is not None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    for root, _, files in os.walk(path):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                continue  # a symlink: not ours, nothing to sync
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def _libc(name: str):
    """The C library's function ``name``, or None where there is none."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
