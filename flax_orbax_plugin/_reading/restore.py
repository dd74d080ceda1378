"""Reading any checkpoint: this library's own, a step's JSON item, or an Orbax directory.

The front of ``fop.restore`` and ``fop.metadata``: it waits for this process's save to
the path, classifies what is there once (``_format.steps.classify``) and dispatches
on that: the native reader (``_core.restore``), a step's JSON item (``_reading.items``)
or the Orbax reader (``_interop.orbax_reader``), none of which knows the others; any
other place is an error that says what is there. Restoring this library's
checkpoints costs no listing.
"""

from __future__ import annotations

from typing import Any

from .._base import distributed as _distributed
from .._base.regions import public
from .._core import formats as _requests
from .._core import handle as _handle
from .._core import restore as _core_restore
from .._core.read_agreement import agree_on_read
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import metadata as _metadata
from .._format import steps as _places
from .._format.foreign import is_step
from .._interop.orbax_layout import open_orbax
from .._interop.orbax_reader import lone_item, restore_orbax
from .._interop.orbax_steps import agreed_latest
from .._like.onto_like import concrete
from .._state.train_state import update_in_place
from .._storage.kvstore import arguments, refusals
from .._storage.location import Location
from . import items as _items

__all__ = ["metadata", "restore"]


# Onto devices of several processes the restore is collective: a failure on one process
# reaches the others at once (``_base.regions``: the region drawn, handed as ``region=``);
# onto host arrays one may read alone (``region`` None).
@public(
    "restore",
    spans=lambda path, like=None, **_: _distributed.spans_processes(like),
    errors=refusals(arguments("path")),
)
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
    """Restores the checkpoint at ``path`` in the form of ``like`` (see
    ``flax_orbax_plugin._core.restore`` for what ``like`` decides). ``path`` may
    also be a step's JSON item (``DIR/<step>/extras``, ``.../step``,
    ``.../data_iterator``): its value is returned (see ``_reading.items``).
    NNX modules, optimizers and Rngs in ``like`` (alone, or in a tuple, list or dict such
    as ``(model, optimizer)``) are restored in place, and ``like``'s objects returned.

    A checkpoint of this library is read by the native reader; when there is none at
    ``path`` and it holds an Orbax checkpoint, that is read instead (through
    tensorstore, without orbax).

    ``share_replicated_reads``: with several processes, a leaf that ``like`` replicates over all
    of them is read once in all (each process reads ``1/P`` of its rows) and the parts are
    all-gathered over jax's collectives, instead of every process reading all of it (measured
    here: 3x faster with 2 processes, 9-10x with 4, on local disk and S3; docs/scaling.md).
    ``None`` (default): on whenever there are several processes; False reads everything on every
    process. Collective: every process must pass the same value.

    ``cast``: ``"safe"`` (default) casts a leaf to the dtype of ``like`` only when no
    value changes beyond float rounding (float32 to bfloat16 rounds; 1e5 to float16,
    300 to int8, 16777217 to float32, float to int or bool raise StructureError);
    ``"unsafe"`` casts as numpy does.

    Restoring into a changed model (see ``_like.transform``): ``partial=True`` leaves out
    saved leaves ``like`` does not have; ``missing="keep"`` keeps ``like``'s own value
    for a leaf the checkpoint lacks (a ShapeDtypeStruct there raises, naming it);
    ``transform`` maps saved leaf paths to ``like``'s: ``{regex: replacement}``
    applied with ``re.sub`` in order, or a callable ``path -> path | None`` (None
    drops the leaf). Without them every difference is listed in one StructureError.

    Layout surgery (see ``_like.surgery``): ``surgery=[fop.Stack(...), fop.Unstack(...),
    fop.Fuse(...), fop.Split(...), fop.Transpose(...), fop.Rename(...)]`` applied in
    order to the saved leaves (after ``transform``), during the read: each target
    shard reads only the regions of the saved leaves it covers. ``dry_run=True``
    returns a :class:`~flax_orbax_plugin.RestorePlan` (which saved leaves and index ranges make each
    leaf of ``like``; ``print`` it) after every check, reading no array data.

    Raises:
      CheckpointNotFoundError: nothing at ``path``.
      NotCommittedError: a save to ``path`` never committed.
      StructureError: ``like`` does not fit (missing or unexpected key, shape, dtype).
        NothingMatchedError (a subclass): no saved leaf matched ``like`` (with
        ``partial``/``missing``/``transform``); ``missing="keep_all"`` accepts it.
      TransformError: ``transform`` or ``surgery`` is malformed (checked before
        anything is read).
      CorruptCheckpointError: a checksum failed or data is missing; names the leaf.
        ForeignEntryError (a subclass): a symlink or special file in the checkpoint.
      StepDeletedError: the checkpoint was deleted (by retention) while being read.
    """
    _requests.check_restore(  # by their declarations, before anything is read
        memory_limit_bytes=memory_limit_bytes, share_replicated_reads=share_replicated_reads
    )
    request = _core_restore.read_request(  # every option checked, before anything is read
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
    location = Location.from_path(path)
    changes = {"partial": partial, "missing": missing, "transform": transform}
    place = _classified(location)
    if place.kind in _places.PYTREES:
        restored = _core_restore.restore_with(location, like, request)
        return update_in_place(like, restored)  # NNX objects: restored in place
    if place.kind == _places.JSON_ITEM:
        return _items.read(place.item, like, changes=changes)
    if place.kind != _places.ORBAX:
        raise _places.not_a_checkpoint(place)  # what is there instead
    if region is not None:  # the processes agree on what they read, as for ours
        agree_on_read(location, concrete(like), request)
    if surgery or dry_run:
        raise CheckpointError(
            f"{location} is an Orbax checkpoint: surgery= and dry_run= apply to this "
            f"library's checkpoints; convert it first (fop.import_orbax(src, dst))"
        )
    return update_in_place(like, _restore_orbax(location, like, region, cast=cast, **changes))


def _classified(location: Location) -> _places.Place:
    """What is at ``location``, once this process's save to it (``fop.save_async``) has
    finished: the one classification the front dispatches on."""
    _handle.wait_for_pending_save(location)
    return _places.classify(location)


def _restore_orbax(
    location: Location,
    like: Any,
    region: _distributed.Region | None,
    *,
    cast: str,
    partial: bool,
    missing: str,
    transform: Any,
):
    """Not one of ours: the Orbax checkpoint at ``location`` read through tensorstore
    (issue 16). Collective when ``like`` spans several processes and ``location`` is a
    run: all read the primary's latest step (agreed in ``region``, the restore's)."""
    if missing != "error" or transform is not None:
        raise CheckpointError(
            f"{location} is an Orbax checkpoint: missing= and transform= apply to this "
            f"library's checkpoints; convert it first (fop.import_orbax(src, dst)) and "
            f"restore the converted step"
        )
    step = None
    if _distributed.spans_processes(like):  # every process reads the primary's latest step
        step = agreed_latest(location, region=region) if not is_step(location) else None
    # cast="unsafe" as for a checkpoint of ours (it was dropped here, silently)
    return restore_orbax(location, like, step=step, partial=partial, cast=cast)


@public(errors=refusals(arguments("path")))
def metadata(path: Any) -> _metadata.CheckpointMetadata:
    """Leaf paths, shapes, dtypes and shardings of a checkpoint; reads no array data.
    On an Orbax checkpoint the error says what it holds and how to read it."""
    location = Location.from_path(path)
    place = _classified(location)
    if place.kind in _places.PYTREES:
        return _core_restore.metadata(location)
    if place.kind == _places.JSON_ITEM:
        return _items.describe(place.item)
    if place.kind == _places.ORBAX:
        raise CheckpointNotFoundError(_orbax_message(location))
    raise _places.not_a_checkpoint(place)


def _orbax_message(location: Location) -> str:
    """What the Orbax checkpoint at ``location`` is and how to read it."""
    try:
        step, items = open_orbax(location)
        what = f"step {step}, " if step is not None else ""
        only = lone_item(location, items)  # not a step of items: its own name is no item's
        what += f"items {sorted(items)}" if only is None else f"one {only.kind} item"
    except (CheckpointError, OSError) as e:
        what = f"unreadable: {e}"
    return (
        f"{location} is an Orbax checkpoint ({what}), not one of this library's: "
        f"fop.metadata describes this library's checkpoints. Read it as it is with "
        f"fop.restore(path, like) or fop.restore_params, or convert it with "
        f"fop.import_orbax(path, out_dir) and inspect the converted steps"
    )
