"""Steps of a checkpoint directory: names, listing, manifests, the latest step.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.steps``.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._base.option_spec import Option, outside_stacklevel
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
)
from .._storage import json_docs as _docs
from .._storage.location import Location
from .foreign import foreign_format_hint
from .layout import MANIFEST_FILE, PENDING_FILE, ItemEntry, StepManifest, decode_checked

# Canonical step names only: ``0`` or digits without a leading zero (``007`` is foreign).
_STEP = r"(0|[1-9][0-9]{0,17})"
MAX_STEP = 10**18 - 1  # the largest step a step directory's name holds (STEP_RE)
STEPS = f"an int step in [0, {MAX_STEP}]"  # what a step option takes, in its errors
# The step option, declared once: every entry point that takes a step checks it so.
STEP = Option("step", "int", low=0, high=MAX_STEP, expected=STEPS)
STEP_OR_NONE = Option(
    "step", "int", none_ok=True, low=0, high=MAX_STEP, expected=f"{STEPS} or None"
)
STEP_RE = re.compile(rf"^{_STEP}$", re.ASCII)
TMP_RE = re.compile(rf"^{_STEP}\.(partial|deleting)-[0-9a-z]{{1,32}}$", re.ASCII)
# The staging of a core save (``fop.save(<dir>/<name>)``), beside its target: not a step.
SAVE_STAGING_RE = re.compile(r"^[^/]+\.(partial|deleting)-[0-9a-z]{1,32}$", re.ASCII)
CORRUPT_RE = re.compile(rf"^{_STEP}\.corrupt-[0-9a-z]{{1,32}}$", re.ASCII)
LOCK_NAME = ".writer.lock"
# Records of ours at the top of a directory (run owner, damaged persistent copies):
# never steps, never foreign. Named here, where listing lives, not imported from
# the modules that write them (they sit above this one).
RECORD_NAMES = frozenset({LOCK_NAME, "_RUN.json", "_DAMAGED.json"})


def is_step_name(name: str) -> bool:
    return bool(STEP_RE.match(name))


@dataclasses.dataclass(frozen=True)
class Listing:
    """What a directory holds, by the rules in the module docstring."""

    committed: tuple[int, ...]
    unfinished: tuple[str, ...]
    corrupt: tuple[str, ...]
    foreign: tuple[str, ...]
    # step folders an environmental error (a permission, an I/O error) kept shut:
    # ``(step, why)``; neither committed (nothing proves it) nor damaged (nothing read)
    unreadable: tuple[tuple[int, str], ...] = ()

    @property
    def latest(self) -> int | None:
        return self.committed[-1] if self.committed else None


def list_directory(loc: Location) -> Listing:
    """Lists ``loc`` without following symlinks; reads no file contents."""
    committed, unfinished, corrupt, foreign, unreadable = [], [], [], [], []
    if loc.is_local:
        kinds = loc.child_kinds()  # from the entries: no link followed
        names = loc.list_children()
        holds = lambda name, file: loc.child(name).exists(file)
    else:  # an object store: one listing of every key says which steps hold which
        kinds, keys = None, set(loc.keys())  # marker (never a read per step: its cost
        names = sorted({k.split("/", 1)[0] for k in keys} - {""})  # grew with the steps)
        holds = lambda name, file: f"{name}/{file}" in keys
    for name in names:
        if name in RECORD_NAMES or name.startswith(".fop-visible-"):  # _shared_dir's probe
            continue
        if kinds is not None and kinds.get(name) != "dir":
            foreign.append(name)  # a symlink, a file, a device: never ours to follow
            continue
        try:
            manifest = STEP_RE.match(name) and holds(name, MANIFEST_FILE)
        except OSError as e:  # a step folder shut by the environment: said, not fatal
            if not environmental(e):
                raise
            unreadable.append((int(name), f"cannot be read: {e}"))
            continue
        if manifest:
            committed.append(int(name))
        elif TMP_RE.match(name) or (STEP_RE.match(name) and holds(name, PENDING_FILE)):
            # (a step written in place on an object store, its writer killed: gc's too)
            unfinished.append(name)
        elif CORRUPT_RE.match(name):
            corrupt.append(name)
        else:
            foreign.append(name)
    return Listing(
        tuple(sorted(committed)),
        tuple(unfinished),
        tuple(corrupt),
        tuple(foreign),
        tuple(sorted(unreadable)),
    )


def committed_steps(loc: Location) -> list[int]:
    """The committed steps of ``loc``, ascending. A step folder the environment keeps
    shut (a permission, an I/O error) is left out, with a warning naming it: it is
    neither chosen as the latest nor taken for damage (nothing is moved or removed)."""
    return committed_of(loc, list_directory(loc))


def committed_of(loc: Location, listing: Listing | None) -> list[int]:
    """:func:`committed_steps` of ``listing``, the listing of ``loc`` made already
    (None: listed here)."""
    listing = listing if listing is not None else list_directory(loc)
    for step, why in listing.unreadable:
        warn_unreadable(loc, step, why)
    return list(listing.committed)


def environmental(error: BaseException) -> bool:
    """Whether ``error`` is the environment's (a permission, an I/O error, a timeout: an
    OSError that is no error of this library), which proves no damage: the step it
    kept shut is skipped for the latest, never set aside."""
    return isinstance(error, OSError) and not isinstance(error, CheckpointError)


def warn_unreadable(loc: Location, step: int, why: _W) -> _W:
    """Warns that step ``step`` of ``loc`` was skipped for the latest: an environmental
    error (``why``) kept it shut. Returns ``why``."""
    text = str(why)
    text = text if text.startswith("cannot be read") else f"cannot be read: {text}"
    warnings.warn(
        f"step {step} of {loc} {text[:500]}; skipped for the latest step (an error of the "
        f"environment, not damage: nothing was moved or removed)",
        UserWarning,
        stacklevel=outside_stacklevel(),
    )
    return why


_T = TypeVar("_T")
_W = TypeVar("_W")


def newest_readable(loc: Location, steps: Sequence[int], read: Callable[[int], _T]) -> _T:
    """``read(step)`` of the newest of ``steps`` (ascending) that the environment lets
    be read: a step whose read fails with an environmental error (:func:`environmental`)
    is skipped with a warning naming it and the next older one is read; damage and
    every other error propagate; when every step is shut, the newest one's error."""
    if not steps:
        raise CheckpointNotFoundError(f"no committed steps in {loc}{foreign_format_hint(loc)}")
    first: OSError | None = None
    for step in reversed(steps):
        try:
            return read(step)
        except OSError as e:
            if not environmental(e):
                raise
            first = first or e
            warn_unreadable(loc, step, e)
    assert first is not None
    raise first


def choose_step(loc: Location, steps: list[int] | tuple[int, ...], step: int | None) -> int:
    """``step`` if committed, or the latest; CheckpointNotFoundError naming what exists."""
    if not steps:
        raise CheckpointNotFoundError(f"no committed steps in {loc}{foreign_format_hint(loc)}")
    if step is None:
        return steps[-1]
    step = checked_step(step)
    if step not in steps:
        raise CheckpointNotFoundError(f"step {step} does not exist in {loc}; steps: {list(steps)}")
    return step


def checked_step(step: Any) -> int:
    """``step`` checked by its one declaration (:data:`STEP`): an int in ``[0,
    MAX_STEP]``, numpy and jax integer scalars too, never a bool (True read as step 1)
    nor a str or float (4.7 truncated to 4); OptionTypeError / OptionError naming it."""
    return STEP.check(step)


def step_location(loc: Location, step: int) -> Location:
    return loc.child(str(operator.index(step)))


def read_manifest(step_loc: Location) -> StepManifest:
    """The validated manifest of a committed step (checksum checked)."""
    raw = step_loc.read_bytes(MANIFEST_FILE)
    if raw is None:
        raise CheckpointNotFoundError(f"{step_loc} is not a committed step (no {MANIFEST_FILE})")
    return _checked_manifest(step_loc, raw)


def _checked_manifest(step_loc: Location, raw: bytes) -> StepManifest:
    """The manifest of the step at ``step_loc`` from its bytes ``raw``, checked as
    :func:`read_manifest` says."""
    where = f"{step_loc}/{MANIFEST_FILE}"
    manifest = StepManifest.from_bytes(raw, where)
    if STEP_RE.match(step_loc.name) and manifest.step != int(step_loc.name):
        raise CorruptCheckpointError(
            f"{where}: field step: expected {int(step_loc.name)} (the directory's name), "
            f"found {manifest.step}"
        )
    _check_item_folders(step_loc, manifest)
    return manifest


def manifest_damage(loc: Location, step: int) -> CheckpointError | None:
    """Why the manifest of committed ``step`` of ``loc`` does not read whole (None: it
    does). Retention (the writer's and ``gc``'s) neither counts nor removes such a step."""
    try:
        read_manifest(step_location(loc, step))
    except CheckpointError as e:
        return e
    return None


def _check_item_folders(step_loc: Location, manifest: StepManifest) -> None:
    """On local disk, every item folder the manifest names is a directory of the step
    itself: a symlink there (to a folder outside the step) is never followed, by any
    reader of the step or of the item. A missing folder is left to the item's reader."""
    if not step_loc.is_local:
        return
    kinds = step_loc.child_kinds()
    for name, entry in manifest.items.items():
        kind = kinds.get(entry.dir, "dir")
        if kind != "dir":
            raise ForeignEntryError(
                f"{step_loc.child(entry.dir)}: the folder of item {name!r} of step "
                f"{manifest.step}: expected a directory written by this library, found a "
                f"{'symbolic link' if kind == 'symlink' else kind} (never followed or read)"
            )


def write_manifest(step_loc: Location, manifest: StepManifest) -> None:
    step_loc.write_bytes(MANIFEST_FILE, manifest.to_bytes())


def manifest_for_item(item_loc: Location) -> StepManifest | None:
    """The manifest of the step holding ``item_loc`` (None when its parent is no step)."""
    parent = item_loc.parent
    raw = parent.read_bytes(MANIFEST_FILE)  # read once: absent, or the manifest checked
    if raw is None:
        return None
    manifest = _checked_manifest(parent, raw)
    if item_loc.name not in {e.dir for e in manifest.items.values()}:
        return None
    return manifest


@dataclasses.dataclass(frozen=True)
class StepItem:
    """An item of a committed step: its name, kind and the step's manifest."""

    location: Location
    name: str
    entry: ItemEntry
    manifest: StepManifest

    @property
    def is_pytree(self) -> bool:
        return self.entry.kind == "pytree"

    @property
    def label(self) -> str:
        return f"item {self.name!r} ({self.entry.kind}) of step {self.manifest.step}"


def step_item(location: Location) -> StepItem | None:
    """The item of a committed step at ``location``, or None when its parent is no
    committed step listing it (a damaged manifest raises, naming it)."""
    manifest = manifest_for_item(location)
    if manifest is None:
        return None
    name, entry = next((n, e) for n, e in manifest.items.items() if e.dir == location.name)
    return StepItem(location, name, entry, manifest)


def read_item_json(item_loc: Location, name: str) -> object:
    """A JSON file of a step's item, checked against the checksum in the step manifest."""
    where = f"{item_loc}/{name}"
    manifest = manifest_for_item(item_loc)
    if manifest is None:
        raise CorruptCheckpointError(f"{where}: not inside a committed step")
    expected = manifest.file_checksum(item_loc.name, name)
    if expected is None:
        raise CorruptCheckpointError(f"{where}: the step manifest records no checksum for it")
    raw = item_loc.read_bytes(name)
    if raw is None:
        raise CorruptCheckpointError(f"{where} is missing (the step manifest lists it)")
    return decode_checked(raw, where, expected, _docs.JSON_ITEM)
