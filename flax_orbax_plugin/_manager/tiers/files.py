"""The files of a step, for the persistent tier (see ``docs/tiers.md``): listing and
reading (never through a link), their partition among processes, and
:func:`copy_files`. Functions of their arguments only; thread-safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..._base import env as _env
from ..._core import ownership as _ownership
from ..._errors import CheckpointError, CorruptCheckpointError, ForeignEntryError
from ..._format.layout import MANIFEST_FILE, StepManifest, manifest_from_bytes
from ..._storage.location import Location
from .state import Stopped

logger = logging.getLogger("flax_orbax_plugin")


COPY_THREADS = 16  # files copied at once (object stores are latency-bound)
PIECE_BYTES = 16 << 20  # local to local under a ceiling: a piece of a file, at most
FILE_COST_BYTES = 1 << 16  # a file's cost beyond its bytes when shares are balanced


def copy_files(
    src: Location,
    dst: Location,
    files: list[str],
    manifest: StepManifest,
    *,
    before_file: Callable[[], None],
    stopped: Callable[[], bool],
    memory_limit: int | None = None,
) -> int:
    """Copies ``files`` (not the manifest) from the step ``src`` into ``dst``, each JSON
    file's sha256 checked; ``before_file()`` runs before each, then :class:`Stopped` if
    ``stopped()``. Returns the bytes copied. Without ``memory_limit``, :data:`COPY_THREADS`
    whole files at a time; under it, local to local each thread streams pieces, else one."""
    streamed = memory_limit is not None and src.is_local and dst.is_local
    threads = COPY_THREADS if memory_limit is None or streamed else 1
    piece = (
        PIECE_BYTES if memory_limit is None else max(1, min(PIECE_BYTES, memory_limit // threads))
    )

    def one(rel: str) -> int:
        before_file()
        if stopped():
            raise Stopped()
        if streamed:
            return _stream(src, dst, rel, manifest.files.get(rel), piece)
        return _whole(src, dst, rel, manifest.files.get(rel), memory_limit)

    total = 0
    # The process's priority (_base.env): a copy may call a store's client.
    with ThreadPoolExecutor(threads, thread_name_prefix="fop-copy") as pool:
        futures = [pool.submit(one, rel) for rel in files]
        try:
            for fut in futures:
                total += fut.result()
                _env.kill_point("mid_replication")
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return total


def _whole(src: Location, dst: Location, rel: str, expected: str | None, limit) -> int:
    """Copies one file read whole, its sha256 checked; one above ``limit`` is said."""
    data = read_remote_file(src, rel)
    if limit is not None and len(data) > limit:
        logger.warning(
            "checkpoint: persistent tier: %s/%s holds %d bytes, above host_memory=%d: "
            "an object store takes and gives a file whole, so it is held whole",
            src,
            rel,
            len(data),
            limit,
        )
    _check_sha(src, rel, expected, hashlib.sha256(data).hexdigest())
    dst.write_bytes(rel, data, durable=False)
    return len(data)


def _stream(src: Location, dst: Location, rel: str, expected: str | None, piece: int) -> int:
    """Copies one local file a piece at a time, its sha256 checked before the rename."""
    pieces = src.read_pieces(rel, piece)
    if pieces is None:
        raise CheckpointError(f"{src}/{rel} vanished while being replicated")
    digest, size = hashlib.sha256(), 0

    def counted():
        nonlocal size
        for chunk in pieces:
            digest.update(chunk)
            size += len(chunk)
            yield chunk
        _check_sha(src, rel, expected, digest.hexdigest())  # before the rename: none kept

    try:
        dst.write_bytes(rel, counted(), durable=False)
    finally:
        pieces.close()
    return size


def _check_sha(src: Location, rel: str, expected: str | None, found: str) -> None:
    if expected is not None and found != expected:
        raise CorruptCheckpointError(
            f"{src}/{rel}: sha256 expected {expected} (the step manifest), found {found}; "
            f"not copied"
        )


def local_files(root: str, step: int) -> list[str]:
    """Relative paths of the regular files of a local step (not the manifest nor marker)."""
    return sorted(local_file_sizes(root, step))


def local_file_sizes(root: str, step: int) -> dict[str, int]:
    """``{relative path: size}`` of :func:`local_files`."""
    out: dict[str, int] = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        top = os.path.join(root, rel_dir) if rel_dir else root.rstrip("/")
        try:
            with os.scandir(top) as it:
                entries = list(it)
        except FileNotFoundError:
            raise CheckpointError(f"step {step}: {top} vanished while being replicated") from None
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                stack.append(rel)
            elif stat.S_ISREG(st.st_mode):
                if rel not in (MANIFEST_FILE, _ownership.PENDING_FILE):
                    out[rel] = st.st_size
            else:
                found = "a symbolic link" if entry.is_symlink() else "a special file"
                raise ForeignEntryError(
                    f"step {step}: {entry.path}: expected a regular file or directory written "
                    f"by this library, found {found} (never followed or copied)"
                )
    return out


def listing_digest(sizes: dict[str, int]) -> str:
    """sha256 of the sorted names and sizes: processes that saw the same files agree."""
    text = "".join(f"{rel}\t{sizes[rel]}\n" for rel in sorted(sizes))
    return hashlib.sha256(text.encode()).hexdigest()


def partition(
    sizes: dict[str, int], n: int, holders: dict[str, list[int]] | None = None
) -> list[list[str]]:
    """The files of a step split among ``n`` processes alike on every process: largest
    first, each to the least-loaded of its ``holders`` (None: all). Each share sorted."""
    loads = [0] * n
    shares: list[list[str]] = [[] for _ in range(n)]
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        p = min(range(n) if holders is None else holders[rel], key=lambda i: (loads[i], i))
        shares[p].append(rel)
        loads[p] += sizes[rel] + FILE_COST_BYTES
    return [sorted(share) for share in shares]


def read_local_file(root: str, rel: str, step: int) -> bytes:
    """A file under a local step, of any size, never through a link (``read_bytes``)."""
    data = Location.from_path(root).read_bytes(rel, max_bytes=None)
    if data is None:
        raise CheckpointError(f"step {step}: {root}/{rel} vanished while being replicated")
    return data


def remote_files(step_loc: Location) -> list[str]:
    """Relative paths of the files under a persistent step, pending marker excluded."""
    if step_loc.is_local:
        return local_files(step_loc.path, int(step_loc.name))
    keys = step_loc._kv().list().result()
    return sorted(k.decode("utf-8") for k in keys if k != _ownership.PENDING_FILE.encode())


def read_remote_file(step_loc: Location, rel: str) -> bytes:
    """A file under a persistent step; CorruptCheckpointError when it is missing."""
    if step_loc.is_local:
        return read_local_file(step_loc.path, rel, int(step_loc.name))
    result = step_loc._kv().read(rel).result()
    if result.state != "value":
        raise CorruptCheckpointError(f"{step_loc}/{rel} is missing (it was listed a moment ago)")
    return bytes(result.value)


def parse_manifest(raw: bytes, step_loc: Location, step: int) -> StepManifest:
    """The step manifest read from ``step_loc``, which must name ``step``."""
    where = f"{step_loc}/{MANIFEST_FILE}"
    manifest = manifest_from_bytes(raw, where)
    if manifest.step != step:
        raise CorruptCheckpointError(
            f"{where}: field step: expected {step} (the directory's name), found {manifest.step}"
        )
    return manifest


def check_listed(manifest: StepManifest, files: list[str], where: str) -> None:
    """Every JSON file the manifest lists is present (else the copy would be partial)."""
    present = set(files)
    missing = [f for f in manifest.files if f not in present]
    if missing:
        raise CorruptCheckpointError(
            f"{where}: files listed in {MANIFEST_FILE} are missing: "
            + ", ".join(sorted(missing)[:5])
        )
