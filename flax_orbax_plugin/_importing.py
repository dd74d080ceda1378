"""Turning a foreign checkpoint's trees into a step of a ``CheckpointManager`` directory.

Shared by the Orbax and msgpack importers. Who calls what: an importer reads one
foreign step into ``{item name: tree or JSON value}``, maps it with
:func:`step_items`, and hands an iterator of steps to :func:`save_steps`, which
writes each through the public ``CheckpointManager.save`` (so the on-disk layout
is exactly what a training job writes).

It also holds the one opener of untrusted local files that every importer
(Orbax, msgpack, safetensors) uses: :func:`open_regular` opens with
``O_NONBLOCK`` (a FIFO never blocks), optionally ``O_NOFOLLOW``, and refuses
anything that is not a regular file with a :class:`ForeignEntryError` naming the
path and what was found; :func:`read_capped` reads such a file whole, at most a
cap of bytes, checked against ``fstat`` before anything is allocated.

Thread-safety: every function here is safe to call from any thread.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
    StructureError,
)
from ._storage import entry_kind

__all__ = [
    "save_steps",
    "step_items",
    "ImportedStep",
    "open_regular",
    "read_capped",
    "loads_json",
    "refuse_foreign_targets",
]

# Largest JSON document (an index, a header, Orbax metadata) read into memory.
MAX_JSON_BYTES = 64 << 20


def open_regular(path: str, *, follow_links: bool, what: str) -> tuple[int, os.stat_result]:
    """``(fd, fstat)`` of a regular file opened read-only, never blocking.

    ``follow_links``: the path itself may be a symlink (it must resolve to a regular
    file); otherwise a symlink is refused. Directories on the way are resolved by
    the OS as usual (the caller names them). Raises CheckpointNotFoundError when
    nothing is there and ForeignEntryError for a link (when not followed), a FIFO,
    a device, a socket or a directory; ``what`` names the file's role in messages
    ("safetensors file", "msgpack checkpoint").
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow_links:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such {what}") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            try:
                found = entry_kind(os.lstat(path).st_mode)
            except OSError:
                found = "something that cannot be opened"
            raise ForeignEntryError(
                f"{path}: expected a {what} (a regular file), found {found} (not read)"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ForeignEntryError(
                f"{path}: expected a {what} (a regular file), found {entry_kind(st.st_mode)} "
                f"(not read)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_capped(path: str, *, follow_links: bool, what: str, max_bytes: int) -> bytes:
    """The whole of a regular file (see :func:`open_regular`), refused above
    ``max_bytes`` (checked against ``fstat`` first, then while reading: a file that
    grows is noticed)."""
    fd, st = open_regular(path, follow_links=follow_links, what=what)
    try:
        if st.st_size > max_bytes:
            raise CorruptCheckpointError(
                f"{path}: expected a {what} of at most {max_bytes} bytes, found {st.st_size}"
            )
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 24, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise CorruptCheckpointError(
                    f"{path}: expected a {what} of at most {max_bytes} bytes; it grew past that"
                )
        return b"".join(chunks)
    finally:
        os.close(fd)


def loads_json(raw: bytes, where: str) -> Any:
    """Parses untrusted JSON; CorruptCheckpointError naming ``where`` for bad UTF-8,
    bad JSON or nesting too deep for the parser (never a RecursionError)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: JSON nested too deeply to read") from None


ImportedStep = tuple[int, dict[str, Any], dict[str, Any] | None]  # (step, items, extras)


def _to_step_int(value: Any, source: str) -> int:
    arr = np.asarray(value)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer):
        raise StructureError(
            f"leaf 'step' in {source}: expected an integer scalar, "
            f"found {arr.dtype}{list(arr.shape)}"
        )
    return int(arr)


def _split(tree: Any, source: str) -> dict[str, Any]:
    """A training-state dict (it has 'params') gives one item per top-level key."""
    if isinstance(tree, Mapping) and "params" in tree:
        out = {}
        for key, value in tree.items():
            if value is None or (isinstance(value, Mapping) and not value):
                continue  # nothing to save (a static field, an empty optimizer state)
            out[str(key)] = _to_step_int(value, source) if key == "step" else value
        return out
    return {"params": tree}


def step_items(trees: Mapping[str, Any], kinds: Mapping[str, str], *, source: str) -> ImportedStep:
    """Maps a foreign step's items onto this plugin's checkpointables.

    * one pytree item (a lone ``StandardSave``, a msgpack file): a dict with a
      ``params`` key is a training state, each top-level key an item (``params``,
      ``opt_state``, ``step`` ...); any other tree becomes ``params``;
    * several items: an item named like one of ours is kept by name; a pytree item
      holding a training state is split as above; any other pytree is kept by name;
    * JSON items go into ``extras`` under their item name.

    Returns ``(step, items, extras)`` with step left as -1 (the caller decides).
    """
    pytrees = {n: t for n, t in trees.items() if kinds[n] == "pytree" and t is not None}
    extras = {n: t for n, t in trees.items() if kinds[n] == "json"}
    items: dict[str, Any] = {}
    if len(pytrees) == 1:
        ((name, tree),) = pytrees.items()
        items = _split(tree, source) if name != "params" else {"params": tree}
    else:
        for name, tree in pytrees.items():
            parts = _split(tree, source) if name != "params" else {"params": tree}
            if set(parts) == {"params"} and name != "params":
                parts = {name: tree}
            clash = sorted(set(parts) & set(items))
            if clash:
                raise StructureError(
                    f"item {clash[0]!r} of {source}: found in two Orbax items; import them "
                    f"one at a time"
                )
            items.update(parts)
    if "step" in items and not isinstance(items["step"], int):
        items["step"] = _to_step_int(items["step"], source)
    return -1, items, extras or None


def refuse_foreign_targets(out_dir: Any, numbers: Iterable[int]) -> None:
    """ForeignEntryError when ``out_dir`` already holds an entry named like one of
    ``numbers`` that is not a committed step of ours (a user's folder, a file, a
    symlink, the Orbax step of an in-place import): it would be replaced otherwise.
    Reads only the directory listing; writes nothing."""
    from ._steps import list_directory
    from ._storage import Location

    loc = Location.from_path(out_dir)
    if loc.is_local and not os.path.isdir(loc.path):
        return  # nothing there yet (or the manager will refuse what is there)
    foreign = set(list_directory(loc).foreign)
    for number in numbers:
        if str(number) in foreign:
            raise ForeignEntryError(
                f"{loc.child(str(number))}: importing step {number} would replace this entry, "
                f"which is not a committed step of this library (a folder of your own, or the "
                f"source checkpoint's own step when importing in place); it is left alone and "
                f"nothing was written. Import into another output directory."
            )


def save_steps(
    out_dir: Any,
    steps: Iterable[tuple[int, ImportedStep]],
    *,
    force: bool,
    planned: Iterable[int] = (),
) -> list[int]:
    """Saves each ``(step, (_, items, extras))`` as a committed step of ``out_dir``.

    A step that already exists there is an error unless ``force`` (then replaced);
    an entry named like the step that is not a committed step of ours is always an
    error (ForeignEntryError), checked for every ``planned`` step before anything is
    written and again before each step. ``steps`` is consumed lazily: one step's trees
    are in memory at a time. Returns the steps written, in order.
    """
    from ._manager import CheckpointManager

    refuse_foreign_targets(out_dir, list(planned))
    written = []
    with CheckpointManager(out_dir, async_save=False) as mngr:
        for number, (_, items, extras) in steps:
            refuse_foreign_targets(out_dir, [number])
            if not force and number in mngr.steps():
                raise FileExistsError(
                    f"{out_dir}: step {number} exists already; pass force=True (--force) "
                    f"to replace it"
                )
            # overwrite: an imported step may lie below the latest one (no training run
            # is resumed here); an existing step was refused above unless force.
            mngr.save(number, items, extras=extras, force=True, overwrite=True)
            written.append(number)
            del items, extras  # one step's trees at a time
    return written


def import_checkpoint(
    src: Any, out_dir: Any, *, step: int | None = None, force: bool = False
) -> list[int]:
    """``flax-orbax import``: an Orbax directory or Flax msgpack file(s) into ``out_dir``.

    Orbax (a manager, step or item directory) goes through
    :func:`flax_orbax_plugin._orbax_import.import_orbax`; a msgpack file or a
    ``flax.training.checkpoints`` directory through
    :func:`flax_orbax_plugin._msgpack_import.import_msgpack`. Returns the steps written.
    """
    import os

    from ._errors import CheckpointNotFoundError
    from ._msgpack_import import import_msgpack
    from ._orbax_import import import_orbax, is_orbax_checkpoint

    if is_orbax_checkpoint(src):
        return import_orbax(src, out_dir, step=step, force=force)
    if os.path.exists(os.fspath(src)):
        return import_msgpack(src, out_dir, step=step, force=force)
    raise CheckpointNotFoundError(f"{src}: no such file or directory")
