"""``verify``: check everything restore depends on, and report every damaged piece.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.verify``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from .._base import host as _host
from .._base.distributed import public
from .._base.env import Option, check
from .._errors import CheckpointError, OptionError, OptionTypeError
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import (
    JSON_VALUE_FILE,
    METADATA_FILE,
    ArrayStorage,
    StepManifest,
    batch_dir,
    iterator_state_file,
)
from .._format.steps import STEP_OR_NONE, read_document
from .._storage.location import Location
from .._storage.store_errors import arguments, refusals
from .._zarr import chunks as _chunks
from . import formats as _formats
from . import reads as _reads
from . import restore as _restore
from .reads import make_target

VERIFY: tuple[Option, ...] = (STEP_OR_NONE, Option("all_steps", "flag"), _formats.MEMORY_LIMIT)

VERIFY_BUDGET_BYTES = 16 << 20  # data read but not yet checked (plus one chunk or file)
MIN_WINDOW_BYTES = 64 << 10  # under a ceiling: the window is never smaller

__all__ = ["VerifyResult", "verify"]

Progress = Callable[[int, str], Any]  # (total_bytes, what) -> a context with advance()


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """The verdict on one checkpoint piece: a step's item (``step``, ``item`` set), a
    whole step whose manifest is unreadable (``item`` None), or a core checkpoint."""

    path: str
    step: int | None
    item: str | None
    ok: bool
    error: str | None = None
    note: str | None = None  # a host's own copy of a step: what it holds (and not)


@public(errors=refusals(arguments("path")))
def verify(
    path: Any,
    *,
    step: int | None = None,
    all_steps: bool = False,
    progress: Progress | None = None,
    memory_limit_bytes: int | None = None,
) -> list[VerifyResult]:
    """Verifies ``path``: a directory of steps (its latest step, ``step``, or with
    ``all_steps`` every committed step), one step, one item of a step, or a standalone
    core checkpoint. Returns one :class:`VerifyResult` per piece; never raises for
    damage (only :class:`CheckpointNotFoundError` when nothing checkable is there).

    ``progress``: called once per pytree checked, in the calling thread, as
    ``progress(total_bytes, what)`` (``what``: ``"step 30/params"``, or the path of a
    core checkpoint); it returns a context manager whose ``advance(nbytes, note)`` is
    called, in the same thread, as each read is checked (the CLI's progress bar).

    ``memory_limit_bytes``: the host-memory ceiling of the reads (None: the fixed
    window, ``VERIFY_BUDGET_BYTES``, and one more read): the reads in flight hold
    at most half of it each time one more is submitted, so never more than it.
    """
    given = {"step": step, "all_steps": all_steps, "memory_limit_bytes": memory_limit_bytes}
    options = check(VERIFY, given)  # OptionError naming one
    if options["all_steps"] and options["step"] is not None:
        raise OptionError(
            f"step={options['step']} and all_steps=True conflict: all_steps verifies every "
            "step, step= one of them; give one of the two"
        )
    budget = window_bytes(options["memory_limit_bytes"])
    if progress is not None and not callable(progress):
        raise OptionTypeError(f"progress: expected a function or None, found {progress!r:.60}")
    loc = Location.from_path(path)
    place = _steps.classify(loc)  # what is there, once: the dispatch below
    if place.kind == _steps.CHECKPOINT:
        _no_step_chosen(loc, "a core checkpoint", None, step)
        return [_verify_pytree(loc, None, None, progress, budget)]
    if place.kind in (_steps.STEP_KIND, _steps.HOST_COPY):
        _no_step_chosen(loc, "one step", _step_number(loc), step)
        return verify_step(loc, _step_number(loc), progress=progress, budget=budget)
    if place.item is not None:  # an item of a step: checked as its kind is, as the step's are
        name, manifest = place.item.name, place.item.manifest
        number = _step_number(loc.parent)
        _no_step_chosen(loc, f"item {name!r} of a step", number, step)
        copy, problem = _steps.of_step(loc.parent)
        if problem is not None:
            return [VerifyResult(str(loc), number, name, False, problem)]
        return [_verify_item(loc.parent, manifest, name, number, progress, copy, budget)]
    if place.staged == METADATA_FILE:  # a pytree never committed: its verdict says so
        _no_step_chosen(loc, "a pytree", _step_number(loc.parent), step)
        return [_verify_pytree(loc, _step_number(loc.parent), loc.name, progress, budget)]
    if place.kind != _steps.RUN or not place.listing.committed:
        raise _steps.no_steps(place)  # says what is there instead
    committed = place.listing.committed
    chosen = committed if all_steps else [_steps.choose_step(loc, committed, step)]
    out: list[VerifyResult] = []
    for s in chosen:
        out.extend(verify_step(_steps.step_location(loc, s), s, progress=progress, budget=budget))
    return out


def window_bytes(limit: int | None) -> int:
    """Half of the ceiling ``limit`` (the window and one read past it), bounded."""
    if limit is None:
        return VERIFY_BUDGET_BYTES
    return max(MIN_WINDOW_BYTES, min(VERIFY_BUDGET_BYTES, limit // 2))


def _no_step_chosen(loc: Location, what: str, own: int | None, step: Any) -> None:
    """Where ``path`` names ``what`` itself, a ``step=`` other than its own is refused."""
    if step is not None and step != own:
        raise OptionError(
            f"step={step}: {loc} is {what}, not a directory of steps; step= chooses among "
            "a run directory's steps (give the run directory, or leave it out)"
        )


def _step_number(loc: Location) -> int | None:
    return int(loc.name) if _steps.is_step_name(loc.name) else None


def verify_step(
    step_loc: Location,
    step: int | None,
    *,
    progress: Progress | None = None,
    budget: int = VERIFY_BUDGET_BYTES,
) -> list[VerifyResult]:
    """Every item of one step; a bad manifest or host marker is one failed result."""
    try:
        manifest = _layout.read_manifest(step_loc)
        copy, problem = _steps.of_step(step_loc)
    except CheckpointError as e:
        return [VerifyResult(str(step_loc), step, None, False, str(e))]
    if problem is not None:
        return [VerifyResult(str(step_loc), step, None, False, problem)]
    return [
        _verify_item(step_loc, manifest, name, step, progress, copy, budget)
        for name in manifest.items
    ]


def _verify_item(step_loc, manifest: StepManifest, name, step, progress, copy, budget: int):
    """One item of a step: the files its kind needs, its JSON checksums, a pytree's data."""
    entry = manifest.items[name]
    item_loc, kind = step_loc.child(entry.dir), entry.kind
    note = None if copy is None else copy.note
    elsewhere = set() if copy is None else copy.elsewhere(kind, manifest.process_count)
    prefix = f"{item_loc.name}/"
    listed = [f[len(prefix) :] for f in manifest.files if f.startswith(prefix)]
    required = {"pytree": [METADATA_FILE], "json": [JSON_VALUE_FILE], "step": [JSON_VALUE_FILE]}
    if kind == "data_iterator":
        required[kind] = [iterator_state_file(p) for p in range(manifest.process_count)]
    try:
        for needed in required.get(kind, []):
            if needed not in listed:
                raise CheckpointError(
                    f"item {name!r} ({kind}): the step manifest lists no {needed}; expected "
                    f"one for every {kind} item"
                )
        for file in listed:
            if file in elsewhere and not item_loc.exists(file):
                continue  # another host's file, in that host's own directory
            if file != METADATA_FILE:  # read with its pytree below
                _layout.read_item_json(item_loc, file)
    except CheckpointError as e:
        return VerifyResult(str(item_loc), step, name, False, str(e), note)
    if kind == "pytree":
        return _verify_pytree(item_loc, step, name, progress, budget, copy)
    return VerifyResult(str(item_loc), step, name, True, None, note)


def _verify_pytree(loc: Location, step, item, progress, budget: int, copy=None) -> VerifyResult:
    what = str(loc) if step is None else f"step {step}" + (f"/{item}" if item else "")
    held = None if copy is None or item is None else copy.item(item)
    note = None if copy is None else copy.note
    try:
        check_pytree(loc, progress=progress, what=what, held=held, budget=budget)
    except CheckpointError as e:
        return VerifyResult(str(loc), step, item, False, str(e), note)
    return VerifyResult(str(loc), step, item, True, None, note)


def check_pytree(
    location: Location,
    *,
    budget: int = VERIFY_BUDGET_BYTES,
    progress: Progress | None = None,
    what: str = "",
    held: _steps.HeldItem | None = None,
) -> None:
    """Checks a committed pytree as restore reads it, ``budget`` bytes at a time."""
    _host.wait_for_pending_save(location)
    doc = read_document(location)
    location.check_no_links(read=_formats.checkpoint_names)  # tensorstore follows links
    targets = [make_target(i, rec, None, cast="safe") for i, rec in enumerate(doc.leaves)]
    fmt = _formats.of_document(doc)  # picked once, from the metadata
    skipped = set() if held is None else held.skipped_batches(doc)
    whole = targets if held is None else [t for t in targets if held.whole(t.record, skipped)]
    with _open_progress(progress, doc, what or str(location), held, skipped) as bar:
        direct = fmt.open(location, doc, whole, own_copy=False)  # claims checked first
        window = _Window(location, budget, bar)
        _check_data(location, doc, targets, fmt, direct, window, budget, held, skipped)


def _open_progress(progress: Progress | None, doc: Any, what: str, held, skipped) -> Any:
    if progress is None:
        return contextlib.nullcontext(None)
    total = sum(
        _steps.held_bytes(
            None if held is None else held.regions(rec),
            rec.shape,
            _layout.dtype_from_name(rec.dtype).itemsize,
        )
        for rec in doc.leaves
        if isinstance(rec.storage, ArrayStorage)
    )
    total += sum(
        b.size * _layout.dtype_from_name(b.dtype).itemsize
        for name, b in doc.batches.items()
        if name not in skipped
    )
    return progress(total, what)


def _check_data(location, doc, targets, fmt, direct, window: _Window, budget, held, skipped):
    try:
        fmt.check_lengths(location, direct)  # nothing past what was written
        for target in targets:
            record = target.record
            if not isinstance(record.storage, ArrayStorage):
                continue
            spans = [None] if held is None else held.regions(record)
            if spans == []:
                continue  # a leaf this host's copy holds nothing of
            store = fmt.array_store(location, target, [record.path])  # v1: its zarr.json
            itemsize = target.dtype.itemsize
            chunk = record.storage.chunk_shape
            for span in spans or [None]:
                for region in _chunks.within(record.shape, span, chunk, itemsize, budget):
                    nbytes = _chunks.nbytes(region, record.shape, itemsize)
                    read = _restore.read_region(fmt, store, target, direct, region)
                    window.submit(read, nbytes, [record.path])
        for name, batch in doc.batches.items():
            if name not in skipped:
                _check_batch(location, doc, batch, fmt, direct, window, budget)
        window.drain(0)
    finally:
        if direct is not None:
            direct.close()


class _Window:
    """Reads in flight, at most ``budget`` bytes (plus the last); each checked and dropped."""

    def __init__(self, location: Location, budget: int, bar: Any = None):
        self.location, self.budget, self.bar = location, budget, bar
        self.pending: collections.deque = collections.deque()
        self.in_flight = 0

    def submit(self, read: Any, nbytes: int, paths: list[str], locate: Any = None) -> None:
        """``locate()``, called on damage, narrows ``paths`` to the leaves damaged."""
        self.pending.append((read, nbytes, paths, locate))
        self.in_flight += nbytes
        self.drain(self.budget)

    def drain(self, to: int) -> None:
        while self.pending and (self.in_flight > to or to == 0):
            read, nbytes, paths, locate = self.pending.popleft()
            self.in_flight -= nbytes
            try:
                read.result()
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001  (tensorstore: ValueError with a status text)
                _reads.raise_environmental(e)
                damaged = (locate() if locate is not None else None) or paths
                raise _reads.corrupt(damaged, self.location, e) from None
            if self.bar is not None:
                self.bar.advance(nbytes, paths[0] if len(paths) == 1 else "")


def _damaged_leaves(store, members: list) -> list[str]:
    """The leaves among ``members`` (of one batch) whose own elements fail to read alone."""
    bad = []
    for rec in members:
        off, size = rec.storage.offset, rec.storage.size
        try:
            _reads.ReadInto(store[off : off + size]).result()
        except Exception as e:  # noqa: BLE001 - damage is collected, the rest raised
            _reads.raise_environmental(e)
            bad.append(rec.path)
    return bad


def _check_batch(location, doc, batch, fmt, direct, window: _Window, budget: int) -> None:
    """Reads a batch a few files at a time; damage names the leaves in the files that failed."""
    members = [
        rec
        for rec in doc.leaves
        if isinstance(rec.storage, _layout.BatchStorage) and rec.storage.batch == batch.name
    ]
    paths = [r.path for r in members]
    try:  # version 1: its zarr.json; 2: compressed, its shards fetched (else None)
        store = fmt.batch_store(location, batch, direct, paths)
    except fmt.batch_damage as e:
        raise _restore.corrupt(paths, location, e) from None
    dtype = _layout.dtype_from_name(batch.dtype)
    itemsize, chunk = dtype.itemsize, int(batch.chunk)
    files = -(-batch.size // chunk)
    per_group = max(1, budget // (chunk * itemsize))
    for first in range(0, files, per_group):
        group = range(first, min(files, first + per_group))
        lo, hi = group.start * chunk, min(batch.size, group.stop * chunk)
        if direct is not None and batch.codec is None:
            sub = batch_dir(batch.name)
            read = direct.read_batch(sub, batch.size, chunk, batch.inner, dtype, group)
        else:
            read = _reads.ReadInto(store[lo:hi])
        inside = [
            r for r in members if r.storage.offset < hi and r.storage.offset + r.storage.size > lo
        ]
        paths = [r.path for r in inside] or [f"batch {batch.name}"]
        locate = None if store is None else (lambda inside=inside: _damaged_leaves(store, inside))
        window.submit(read, (hi - lo) * itemsize, paths, locate)
