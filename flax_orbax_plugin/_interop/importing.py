"""Importing a foreign checkpoint's trees as steps of a ``CheckpointManager`` directory:
each importer checks its options and paths, reads a step, decides its number and items,
and hands the steps to ``save_steps`` (the public ``CheckpointManager.save``). Any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._interop.importing``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._base import host_memory as _host_memory
from .._base import shown as _shown
from .._base.distributed import public
from .._base.env import check
from .._base.shown import outside_stacklevel
from .._core import ownership as _ownership
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
    OptionError,
    StructureError,
    UnsupportedLocationError,
)
from .._format.foreign import (
    STEP_RE,
    is_msgpack_checkpoint,
    is_orbax_checkpoint,
    is_step,
    safetensors_source,
)
from .._format.steps import holding_checkpoint, list_directory
from .._manager import options as _options
from .._manager.manager import CheckpointManager
from .._storage.local_inputs import local_path
from .._storage.location import Location
from .._storage.lock import LOCK_FILE
from .._storage.store_errors import arguments, refusals
from . import msgpack_reader, orbax_reader
from .orbax_layout import open_orbax
from .orbax_steps import list_steps
from .safetensors.headers import read_safetensors_index as headers
from .safetensors.headers import tree_of_names
from .safetensors.reader import from_safetensors

__all__ = ["import_checkpoint", "import_msgpack", "import_orbax"]


logger = logging.getLogger("flax_orbax_plugin")


def state_step(tree: Any, path: str) -> int | None:
    """The state's top-level ``step`` leaf (a ``TrainState``'s) as an int, or None."""
    value = tree.get("step") if isinstance(tree, dict) else None
    if isinstance(value, dict | list | str | bytes) or value is None:
        return None  # no step, or a subtree named step
    return _to_step_int(value, path)


def choose_step(path: str, *, given: int | None, named: int | None, stored: int | None) -> int:
    """``given`` (it must equal ``stored``, the state's own), else ``stored`` (a differing
    ``named`` is warned of), else ``named`` (its name's), else a StructureError."""
    if given is not None:
        if stored is not None and stored != given:
            raise StructureError(
                f"{path}: step {given} was asked for, but the state's step leaf says "
                f"{stored}; import it as step {stored} (or leave the step out)"
            )
        return given
    if stored is not None:
        if named is not None and named != stored:
            logger.warning(
                "import: %s is named for step %d but its state's step leaf says %d: "
                "imported as step %d (pass step= to choose)",
                path,
                named,
                stored,
                stored,
            )
        return stored
    if named is not None:
        return named
    raise StructureError(
        f"{path}: no step to import it as: the state has no top-level 'step' leaf and "
        f"its name no step number; give it (step= in Python, --step on the command line)"
    )


def orbax_steps_to_import(src: Any, step: int | None) -> list[tuple[int, Location]]:
    """``[(step number, step directory)]`` of an Orbax run (or only ``step``), or of a lone
    step or item (``step``, else its own number, else 0)."""
    loc = Location.from_path(src)
    if is_step(loc):
        own, _ = open_orbax(loc)
        return [(step if step is not None else (own if own is not None else 0), loc)]
    listing = list_steps(loc)
    if step is not None:
        return [(listing.choose(step), listing.steps[step])]
    if not listing.steps:
        listing.choose(None)  # an error naming what was passed over
    passed = listing.skipped_above(None)
    if passed:
        logger.warning(
            "%s: importing Orbax steps %s; passed over (not finalized steps): %s",
            loc,
            _shown.listed(sorted(listing.steps)),
            _shown.listed(passed),
        )
    return list(listing.steps.items())


def refuse_mixing(out_dir: Any, held: list[int], planned: list[int], force: bool) -> None:
    """Unless ``force``: refuses a planned step that exists and newer steps; warns of others."""
    if force or not held:
        return
    refuse_existing(out_dir, held, planned, force)
    newer = [s for s in held if planned and s > max(planned)]
    if newer:
        raise FileExistsError(
            f"{out_dir} already holds steps newer than those imported ({_shown.listed(newer)}): "
            "a resume would take them; import into a new directory, or pass force=True (--force)"
        )
    warnings.warn(
        f"{out_dir} already holds steps {_shown.listed(held)}; the imported steps are added "
        "beside them (one run directory holding two runs' steps, if they came from elsewhere)",
        UserWarning,
        stacklevel=outside_stacklevel(),
    )


def refuse_existing(out_dir: Any, held: list[int], numbers: list[int], force: bool) -> None:
    """Unless ``force``: FileExistsError for the first of ``numbers`` in ``held``."""
    clash = [] if force else sorted(set(held) & set(numbers))
    if clash:
        raise FileExistsError(
            f"{out_dir}: step {clash[0]} exists already; to replace it pass force=True "
            f"(--force on the command line)"
        )


ImportedStep = tuple[dict[str, Any], dict[str, Any] | None]  # (items, extras)


def _to_step_int(value: Any, source: str) -> int:
    arr = np.asarray(value)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer) or int(arr) < 0:
        raise StructureError(
            f"leaf 'step' in {source}: expected a non-negative integer scalar (the state's "
            f"step), found {arr.dtype}{list(arr.shape)}"
        )
    return int(arr)


def _split(tree: Any) -> dict[str, Any]:
    """A training-state dict (it has 'params') gives one item per key; another is ``params``."""
    if isinstance(tree, Mapping) and "params" in tree:
        return {str(key): value for key, value in tree.items()}
    return {"params": tree}


def step_items(trees: Mapping[str, Any], kinds: Mapping[str, str], *, source: str) -> ImportedStep:
    """``(items, extras)`` of a foreign step's items: a training state's keys are items,
    another pytree is kept by name; JSON items (and ``metrics``' entries) are extras."""
    pytrees = {n: t for n, t in trees.items() if kinds[n] == "pytree" and t is not None}
    extras = {n: t for n, t in trees.items() if kinds[n] == "json" and n != "metrics"}
    metrics = trees.get("metrics") if kinds.get("metrics") == "json" else None
    if isinstance(metrics, Mapping):
        clash = sorted(set(metrics) & set(extras))
        if clash:
            raise StructureError(
                f"metric {clash[0]!r} of {source}: also the name of a JSON item; import "
                f"one of them only"
            )
        extras.update(metrics)
    elif metrics is not None:
        extras["metrics"] = metrics
    items: dict[str, Any] = {}
    origin: dict[str, str] = {}  # our item -> the foreign item it came from
    for name, tree in pytrees.items():
        parts = _split(tree) if name != "params" else {"params": tree}
        if len(pytrees) > 1 and set(parts) == {"params"} and name != "params":
            parts = {name: tree}  # one of several items, no training state: kept by name
        clash = sorted(set(parts) & set(items))
        if clash:
            raise StructureError(
                f"item {clash[0]!r} of {source}: found in two Orbax items; import them "
                f"one at a time"
            )
        items.update(parts)
        origin.update(dict.fromkeys(parts, name))
    _refuse_reserved(items, origin, source)
    if "step" in items:
        items["step"] = _to_step_int(items["step"], source)
    return items, extras or None


# Item names whose kind this library fixes: a tree saved under one would not come back.
_RESERVED = {
    "extras": "the step's JSON extras (extras=)",
    "data_iterator": "a data iterator's state (data_iterator=)",
}


def _refuse_reserved(items: Mapping[str, Any], origin: Mapping[str, str], source: str) -> None:
    """StructureError for a tree imported under a name reserved for another kind."""
    for name, what in _RESERVED.items():
        if name in items:
            came = origin.get(name, name)
            where = f"Orbax item {name!r}" if came == name else f"key {name!r} of item {came!r}"
            raise StructureError(
                f"item {name!r} of {source}: a tree ({where}), but this library reserves "
                f"the item name {name!r} for {what}; nothing of this step was imported: "
                f"save the tree under another item name"
            )


_NOT_ORBAX = (
    "it holds no Orbax checkpoint, and Flax msgpack and safetensors files are read from "
    "local disk only"
)


def refuse_foreign_targets(out_dir: Any, numbers: Iterable[int]) -> None:
    """ForeignEntryError for an entry of ``out_dir`` named like one of ``numbers``, not ours."""
    loc = Location.from_path(out_dir)
    if loc.is_local and not os.path.isdir(loc.path):
        return  # nothing there yet (or the manager will refuse what is there)
    foreign = set(list_directory(loc).foreign)
    for number in numbers:
        if str(number) in foreign:
            raise ForeignEntryError(
                f"{loc.child(str(number))}: importing step {number} would replace this entry, "
                f"not a committed step of this library; nothing was written: import into "
                f"another output directory"
            )


def refuse_inside_checkpoint(out_dir: Any) -> None:
    """UnsupportedLocationError when ``out_dir`` is or lies inside a checkpoint or run."""
    loc = Location.from_path(out_dir)
    if loc.is_local:  # a link on the way is resolved: the checkpoint it leads into counts
        loc = Location.from_path(os.path.realpath(loc.path))
    held = holding_checkpoint(loc.parent, runs=1)
    if held is not None:
        raise UnsupportedLocationError(
            f"import output {out_dir}: lies inside {held}; a committed checkpoint never "
            f"changes: import into a directory of its own"
        )


def save_steps(
    out_dir: Any,
    steps: Iterable[tuple[int, ImportedStep]],
    *,
    planned: list[int],
    options: Mapping[str, Any],
    source_bytes: Sequence[int],
) -> list[int]:
    """Saves each ``(step, (items, extras))`` of ``steps`` (one step's trees in memory at a
    time) as a committed step of ``out_dir``; returns the steps written."""
    refuse_inside_checkpoint(out_dir)
    refuse_foreign_targets(out_dir, planned)
    loc = Location.from_path(out_dir)
    created = _ownership.missing_directories(loc.path) if loc.is_local else []
    written: list[int] = []
    try:
        _write_steps(out_dir, steps, planned, options, list(source_bytes), written)
    except BaseException as e:  # Ctrl-C too: the manager removed the step in progress
        if written:
            e.add_note(
                f"the import committed step(s) {written} to {loc} before it failed (they are "
                f"whole); a re-run replaces them only with force=True (--force), or import "
                f"the steps left one at a time with step= (--step)"
            )
        else:  # a directory this import created holds only its lock file: both go
            _ownership.remove_created(created, files=(LOCK_FILE,))
        raise
    return written


def _write_steps(out_dir, steps, planned, options, sizes: list[int], written: list[int]) -> None:
    """:func:`save_steps`' manager session; each step saved is added to ``written``."""
    force, limit, progress = options["force"], options["memory_limit_bytes"], options["progress"]
    with (
        CheckpointManager(
            out_dir,
            async_save=False,
            format_version=options["format_version"],
            host_memory=None if limit is None else limit // 2,
        ) as mngr,
        contextlib.nullcontext() if progress is None else progress(sum(sizes)) as bar,
    ):
        refuse_mixing(out_dir, mngr.steps(), planned, force)
        for number, (items, extras) in steps:
            if number in written:  # two sources of one step: one would replace the other
                raise StructureError(
                    f"two checkpoints of this import give step {number}; import them "
                    f"one at a time, each with its own step="
                )
            refuse_foreign_targets(out_dir, [number])
            refuse_existing(out_dir, mngr.steps(), [number], force)
            if limit is not None:  # a row: the least a streamed save copies at once
                row, path = _host_memory.largest_row(items)
                refuse_over(f"step {number}", row, limit, f"a row of leaf {path!r} holds")
            # overwrite: an imported step may lie below the latest (refused above unless force)
            mngr.save(number, items, extras=extras, ignore_policy=True, overwrite=True)
            written.append(number)
            del items, extras  # one step's trees at a time
            if bar is not None:
                bar.advance(sizes[len(written) - 1], "")


def refuse_over(source: Any, nbytes: int, limit: int | None, what: str) -> None:
    """OptionError when ``nbytes`` of ``source`` pass half the ceiling ``limit``: an import
    holds a step in one half, and its save streams under the other."""
    if limit is not None and nbytes > limit // 2:
        raise OptionError(
            f"memory_limit_bytes={limit}: {source}: {what} {nbytes} bytes, above the half "
            f"of the ceiling an import holds a step in (or streams its save under); nothing "
            f"of it was written: give memory_limit_bytes >= {2 * nbytes} (or None)"
        )


def _source_size(path: Any) -> int:
    """Bytes of a local file or directory to import (0 elsewhere)."""
    loc = Location.from_path(path)
    if not loc.is_local:
        return 0
    path = loc.path.rstrip("/")
    return os.path.getsize(path) if os.path.isfile(path) else (loc.size_bytes() or 0)


@public(errors=refusals(arguments("src", "out_dir")))
def import_checkpoint(
    src: Any,
    out_dir: Any,
    *,
    step: int | None = None,
    force: bool = False,
    format_version: int | None = None,
    progress: Callable[[int], Any] | None = None,
    memory_limit_bytes: int | None = None,
) -> list[int]:
    """``flax-orbax import``: an Orbax directory, Flax msgpack file(s) or safetensors
    into ``out_dir``, through the importer of its kind (another file is refused)."""
    options = {"step": step, "force": force, "format_version": format_version}
    options.update(progress=progress, memory_limit_bytes=memory_limit_bytes)
    if is_orbax_checkpoint(src):
        return import_orbax(src, out_dir, **options)
    local = local_path(src, what="import source", note=_NOT_ORBAX)
    real = Location.from_path(os.path.realpath(local))
    ours = holding_checkpoint(real, runs=1) if os.path.isdir(local) else None
    if ours is not None:  # else: "no flax.training.checkpoints files in it"
        raise CheckpointError(
            f"import source {src}: is (or lies inside) {ours}, a checkpoint of this "
            f"library already: nothing to import (read it with fop.restore / "
            f"CheckpointManager, or copy the directory)"
        )
    source = safetensors_source(local)  # by name: the headers are checked on read
    if source is not None:
        return _import_safetensors(src, out_dir, options, source)
    if os.path.isfile(local) and not is_msgpack_checkpoint(local):
        raise CorruptCheckpointError(
            f"import source {src}: a file that is neither a Flax msgpack checkpoint (it "
            f"opens no msgpack map: not a Flax msgpack checkpoint) nor safetensors (no "
            f".safetensors name)"
        )
    if os.path.exists(local):
        return import_msgpack(src, out_dir, **options)
    raise CheckpointNotFoundError(f"{src}: no such file or directory")


def _check(src: Any, out_dir: Any, options: dict[str, Any]) -> None:
    """An importer's front, before it reads: ``options`` checked; UnsupportedLocationError
    when ``out_dir`` lies inside ``src`` (links resolved)."""
    check(_options.IMPORT, options)
    s, o = Location.from_path(src), Location.from_path(out_dir)
    if s.is_local and o.is_local:
        a, b = os.path.realpath(s.path), os.path.realpath(o.path)
        inside = a != b and os.path.commonpath([a, b]) == a
    else:
        where = lambda loc: (loc.spec.get("driver"), loc.spec.get("bucket"))
        inside = where(s) == where(o) and o.path.startswith(s.path.rstrip("/") + "/")
    if inside:
        raise UnsupportedLocationError(
            f"import output {out_dir}: lies inside the source {src}; an import never "
            f"writes into what it reads: import into a directory outside it"
        )


def _import_safetensors(src: Any, out_dir: Any, options: dict[str, Any], source: Any) -> list[int]:
    """Writes safetensors ``source`` as item ``params`` of step ``options["step"]``."""
    _check(src, out_dir, options)
    number = choose_step(str(src), given=options["step"], named=None, stored=None)
    limit = options["memory_limit_bytes"]
    if limit is not None:  # what the headers claim (checked), before a read
        held = sum(math.prod(t.shape) * t.dtype.itemsize for t in headers(source).values())
        refuse_over(src, held, limit, "its tensors hold")
    tensors = from_safetensors(source)  # {name: array}; every header checked
    steps = [(number, ({"params": tree_of_names(tensors)}, None))]
    files = source if isinstance(source, list) else [source]
    sizes = [sum(os.path.getsize(f) for f in files)]
    return save_steps(out_dir, iter(steps), planned=[number], options=options, source_bytes=sizes)


@public(errors=refusals(arguments("src", "out_dir")))
def import_orbax(
    src: Any,
    out_dir: Any,
    *,
    step: int | None = None,
    force: bool = False,
    format_version: int | None = None,
    progress: Callable[[int], Any] | None = None,
    memory_limit_bytes: int | None = None,
) -> list[int]:
    """Writes Orbax checkpoints as steps of a ``CheckpointManager`` directory.

    ``src`` is an Orbax manager directory (every committed step, or only ``step``),
    a step directory or an item directory. Each is written as ``step`` when given
    (refused unless it equals a training state's ``step`` leaf, where there is one),
    else as that leaf, else as the step directory's number; with none of them it is
    refused (``import_step.choose_step``). Leaves are read one at a
    time to host memory and the assembled step is saved with the public
    ``CheckpointManager.save``, so the peak is about twice the step's bytes (the tree,
    then the save's own host snapshot). Returns the steps written. Items map as
    ``step_items`` says. ``progress``: as ``save_steps``'s.
    ``memory_limit_bytes``: the host-memory ceiling: a step whose files (before
    reading) or arrays (once read, before writing) exceed half of it is refused,
    naming both figures; the save streams under the other half (``save_steps``).
    """
    options = {"step": step, "force": force, "format_version": format_version}
    options.update(progress=progress, memory_limit_bytes=memory_limit_bytes)
    _check(src, out_dir, options)
    targets = orbax_steps_to_import(src, step)
    sizes = [_source_size(loc) for _, loc in targets]
    for (_, step_loc), size in zip(targets, sizes, strict=True):
        refuse_over(step_loc, size, memory_limit_bytes, "its files hold")
    states = (_orbax_step(loc, step, memory_limit_bytes) for _, loc in targets)
    planned = [n for n, _ in targets]
    return save_steps(out_dir, states, planned=planned, options=options, source_bytes=sizes)


def _orbax_step(step_loc: Location, step: int | None, limit: int | None):
    """``(step number, imported step)`` of one Orbax step directory, read whole."""
    trees, kinds = orbax_reader.read_step(step_loc)
    refuse_over(step_loc, _host_memory.held_bytes(trees), limit, "its arrays, once read, hold")
    imported = step_items(trees, kinds, source=str(step_loc))
    stored = imported[0].get("step")  # a training state's step leaf, as an int
    named = STEP_RE.match(step_loc.name)  # an Orbax step directory's number
    named = int(named.groups()[-1]) if named else None  # the last group: digits
    return choose_step(str(step_loc), given=step, named=named, stored=stored), imported


@public(errors=refusals(arguments("src", "out_dir")))
def import_msgpack(
    src: Any,
    out_dir: Any,
    *,
    step: int | None = None,
    force: bool = False,
    format_version: int | None = None,
    progress: Callable[[int], Any] | None = None,
    memory_limit_bytes: int | None = None,
):
    """Writes Flax msgpack checkpoints as steps of a ``CheckpointManager`` directory.

    ``src`` is one msgpack file or a ``flax.training.checkpoints`` directory (every
    ``<prefix><step>`` file, or only ``step``). Each is written as ``step`` when given
    (refused unless it equals the state's ``step`` leaf, a Flax ``TrainState``'s,
    where the state has one), else as the state's step, else as the number its name
    ends with; a file with none of them is refused (``import_step.choose_step``),
    the first before anything is written. A state dict with ``params`` is split into
    items (``params``, ``opt_state``, ``step`` ...), any other tree is saved as
    ``params``. Returns the steps written. ``progress``: as ``save_steps``'s.
    ``memory_limit_bytes``: the host-memory ceiling: a file read holds its bytes, then
    its arrays, so a file larger than half the ceiling is refused before anything is
    read, naming both figures; the save streams under the other half (``save_steps``).
    """
    options = {"step": step, "force": force, "format_version": format_version}
    options.update(progress=progress, memory_limit_bytes=memory_limit_bytes)
    _check(src, out_dir, options)
    numbered = msgpack_reader.files_to_import(src, step)
    sizes = [_source_size(path) for _, path in numbered]
    for (_, path), size in zip(numbered, sizes, strict=True):
        refuse_over(path, size, memory_limit_bytes, "its bytes (and then its arrays) hold")

    def read(named: int | None, path: str) -> tuple[int, ImportedStep]:
        tree = msgpack_reader.read_msgpack(path)
        number = choose_step(path, given=step, named=named, stored=state_step(tree, path))
        return number, step_items({"state": tree}, {"state": "pytree"}, source=path)

    first = [read(*numbered[0])]  # its step decided (or refused) before anything is written
    planned = [first[0][0], *(n for n, _ in numbered[1:] if n is not None)]

    def states():  # one file's tree in memory at a time
        yield first.pop()
        yield from itertools.starmap(read, numbered[1:])

    return save_steps(out_dir, states(), planned=planned, options=options, source_bytes=sizes)
