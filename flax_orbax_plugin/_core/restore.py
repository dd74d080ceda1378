"""Restoring a pytree of this library's own, driven by a ``like`` template, and its plan
(``dry_run=True``: the plan is pure).

Threading: reads are issued to tensorstore's own thread pool from the calling thread;
the host-memory budget bounds the bytes of reads in flight.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.restore``.
"""

from __future__ import annotations

from typing import Any

from .._base import distributed as _distributed
from .._base import host as _host
from .._base import tree as _tree
from .._base.env import flag
from .._errors import StructureError, TransformError
from .._format import layout as _layout
from .._format import metadata as _metadata
from .._format.steps import read_document
from .._like import onto_like as _like
from .._like import surgery as _surgery
from .._like import surgery_mirrors as _surgery_mirrors
from .._like import transform as _transform
from .._like.surgery_plan import PlanEntry, RestorePlan, full_box
from .._storage.location import Location
from .._zarr import chunk_files as _chunk_files
from .._zarr import chunks as _chunks
from . import formats as _formats
from .formats import DEFAULT_READ_LIMIT_BYTES, ReadRequest
from .read_agreement import agree_on_read
from .read_data import read_targets
from .reads import Target, add_missing_empties, make_target


def entry_of(target: Target, path: str) -> PlanEntry:
    """``target``'s entry under like's ``path``."""
    record = target.record
    if target.virtual is None:
        box = full_box(tuple(record.shape))
        return PlanEntry(path, tuple(record.shape), record.dtype, ((record.path, box),))
    node = target.virtual.node
    pieces, _ = node.pieces(full_box(node.shape))
    sources = tuple((p.record.path, p.box) for p in pieces)
    return PlanEntry(path, tuple(node.shape), node.dtype, sources, target.virtual.how)


def plan_of(
    where: str, targets: list[Target], paths: list[str], kept: list[str], saved: list[str]
) -> RestorePlan:
    """The plan of reading ``targets`` (like's ``paths``, in order; ``kept``: like's
    leaves kept as they are; ``saved``: the checkpoint's leaves holding values)."""
    entries = tuple(entry_of(t, p) for t, p in zip(targets, paths, strict=True))
    read = {path for e in entries for path, _ in e.sources}
    dropped = tuple(p for p in saved if p not in read)
    return RestorePlan(where, entries, tuple(kept), dropped)


def metadata(path: Any) -> _metadata.CheckpointMetadata:
    """Leaf paths, shapes, dtypes and shardings of this library's checkpoint at
    ``path``; reads no array data (``_reading.restore.metadata`` adds what a foreign
    checkpoint there is)."""
    location = Location.from_path(path)
    _host.wait_for_pending_save(location)
    return _metadata.to_public(read_document(location), str(location))


def restore(
    path: Any,
    like: Any = None,
    *,
    region: _distributed.Region | None,
    partial: bool = False,
    missing: str = "error",
    transform: Any = None,
    surgery: Any = None,
    dry_run: bool = False,
    memory_limit_bytes: int | None = None,
    cast: str = "safe",
    share_replicated_reads: bool | None = None,
) -> Any:
    """Restores this library's own checkpoint at ``path`` in the form of ``like``.

    The native reader behind :func:`flax_orbax_plugin.restore` (``_reading.restore``),
    which documents the arguments and errors and adds the fallback to foreign formats;
    internal callers that read only native checkpoints (items of a step, serving,
    export) call this one. Threading as in the module doc; ``partial``, ``missing`` and
    ``transform`` restore into a changed model (``_like.transform``), ``surgery`` with
    layout changes (``_like.surgery``); ``dry_run=True`` returns the
    :class:`RestorePlan` instead, reading no array data. The options become one
    :class:`ReadRequest` (see :func:`restore_with`), with ``region``: the collective
    operation the read is part of (``_base.regions``; None: a read of one process).
    """
    request = read_request(
        region=region,
        partial=partial,
        missing=missing,
        transform=transform,
        surgery=surgery,
        dry_run=dry_run,
        memory_limit_bytes=memory_limit_bytes,
        cast=cast,
        share_replicated_reads=share_replicated_reads,
    )
    return restore_with(path, like, request)


def read_request(
    *,
    region: _distributed.Region | None,
    partial: bool = False,
    missing: str = "error",
    transform: Any = None,
    surgery: Any = None,
    dry_run: bool = False,
    memory_limit_bytes: int | None = None,
    cast: str = "safe",
    share_replicated_reads: bool | None = None,
) -> ReadRequest:
    """The :class:`ReadRequest` of :func:`restore`'s options, checked (by their
    declarations first) before anything is read."""
    _formats.check_restore(
        memory_limit_bytes=memory_limit_bytes, share_replicated_reads=share_replicated_reads
    )
    dry_run = flag("dry_run", dry_run)
    share = share_replicated_reads
    return ReadRequest(
        memory_limit_bytes=memory_limit_bytes or DEFAULT_READ_LIMIT_BYTES,
        cast=cast,
        share_reads=_distributed.process_count() > 1 if share is None else bool(share),
        changes=_transform.changes(
            partial=partial, missing=missing, transform=transform, surgery=surgery
        ),
        dry_run=dry_run,
        region=region,
    )


def restore_with(path: Any, like: Any, request: ReadRequest) -> Any:
    """:func:`restore` with its modes given as one request (a manager's items, the
    tier): the same read, nothing taken from anywhere but the arguments."""
    location = Location.from_path(path)
    _host.wait_for_pending_save(location)
    with _tree.paused_gc():
        return _restore(location, like, request)


def _dropped_or_same(opts: _transform.Changes, path: str) -> bool:
    """With ``like=None`` a transform may only drop leaves (False): there is no
    structure to place a renamed one in."""
    new = opts.rename(path)
    if new is not None and new != path:
        raise TransformError(
            f"transform renames the saved leaf {path!r} to {new!r}, which needs like (the "
            f"tree to place it in); with like=None a transform may only drop leaves (None)"
        )
    return new is not None


def _restore(location: Location, like: Any, request: ReadRequest) -> Any:
    """The read: the processes agree, the document is read and checked, then its leaves
    are read whole (``like`` None) or onto ``like``."""
    like = _like.concrete(like)  # shardings on an AbstractMesh: onto set_mesh's mesh
    if not request.own_copy and request.region is not None:  # a collective read
        agree_on_read(location, like, request)  # the same on every process, before a byte
    opts = request.changes
    if location.is_local and not opts.partial and opts.transform is None and not opts.surgery:
        # every batch is read whole: the disk starts on it while the metadata is parsed
        _chunk_files.prefetch_batches(location.path, _chunks.THREADS)
    doc = read_document(location)
    location.check_no_links(read=_formats.checkpoint_names)  # tensorstore follows links
    saved = [rec.path for rec in doc.leaves if rec.kind not in _transform.NO_DATA]
    if like is None:
        return _as_saved(location, doc, request, saved)
    return _read_onto_like(location, doc, like, request, saved)


def _as_saved(location: Location, doc, request: ReadRequest, saved: list[str]) -> Any:
    """``like=None``: the saved leaves (a transform may drop some) on the host, as saved."""
    opts = request.changes
    if opts.surgery:
        raise TransformError(
            f"surgery= makes leaves like places (restore of {location}): pass like"
        )
    leaves = list(enumerate(doc.leaves))
    if opts.transform is not None:
        leaves = [(i, rec) for i, rec in leaves if _dropped_or_same(opts, rec.path)]
        if all(rec.kind in _transform.NO_DATA for _, rec in leaves):
            _transform.check_matched(saved, None, [], opts, str(location))
    targets = [make_target(i, rec, None, cast=request.cast) for i, rec in leaves]
    if request.dry_run:
        paths = [t.record.path for t in targets]
        return plan_of(str(location), targets, paths, [], saved)
    read_targets(location, doc, targets, request)
    return _tree.rebuild([(list(t.record.keys), t.result) for t in targets])


def _read_onto_like(location: Location, doc, like: Any, request: ReadRequest, saved: list[str]) -> Any:
    """The saved leaves (renamed, made by the surgery) matched to ``like``'s and read onto
    them; a leaf ``like`` keeps (``missing="keep"``) is its own."""
    opts = request.changes
    flat, treedef = _tree.flatten(like)
    records = {rec.path: (i, rec) for i, rec in enumerate(doc.leaves)}
    records = _transform.rename_records(records, opts, str(location))
    made, problems = {}, []
    if opts.surgery:
        ops = opts.surgery
        if opts.surgery_mirrored:  # an optimizer state: the ops at each mirror of params
            ops = _surgery_mirrors.mirrored(ops, records)
        records, made, problems = _surgery.apply(records, ops)
    add_missing_empties(flat, records)
    plan = _transform.match(
        flat,
        records,
        opts,
        where=str(location),
        make=_maker(made, request.cast),
        problems=problems,  # the operations' own, listed first
        empty_kinds=_layout.EMPTY_KINDS,
        saved=saved,
        cast=request.cast,
    )
    targets = [t for t in plan if t is not _transform.KEEP]
    paired = list(zip(plan, flat, strict=True))
    if request.dry_run:
        paths = [p for t, (p, _, _) in paired if t is not _transform.KEEP]
        kept = [p for t, (p, _, _) in paired if t is _transform.KEEP]
        return plan_of(str(location), targets, paths, kept, saved)
    read_targets(location, doc, targets, request)
    results = [leaf if t is _transform.KEEP else t.result for t, (_, _, leaf) in paired]
    return _tree.unflatten(treedef, results)


def _maker(made: dict[str, Any], cast: str):
    """``make(i, record, leaf)``: a leaf's target (through the operations that made it)."""

    def make(i, rec, leaf):
        found = made.get(rec.path)
        if found is None or found.record is not rec:
            return make_target(i, rec, leaf, cast=cast)
        try:
            target = make_target(i, rec, leaf, cast=cast)
        except StructureError as e:
            raise StructureError(f"{e} (as surgery made it: {found.how})") from None
        target.virtual = found
        return target

    return make
