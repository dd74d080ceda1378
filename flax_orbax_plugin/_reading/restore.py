"""Reading any checkpoint (this library's own, a step's JSON item, or an Orbax directory):
the front of ``fop.restore``, ``fop.metadata`` and ``fop.restore_params``.

``restore`` and ``metadata`` first wait for this process's save to the path. A JSON
item's read is safe from any thread; ``restore_params`` from any thread and any
process, even while a manager writes to the directory.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._reading.restore``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import host as _host
from .._base.distributed import public
from .._base.env import check
from .._core import restore as _restore
from .._core.reads import ReadRequest, agree_on_read, place
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    OptionError,
    OptionTypeError,
    StructureError,
)
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.foreign import is_step
from .._format.layout import STEP_VERSION
from .._format.steps import StepItem
from .._interop import hf_shards as _hf_shards
from .._interop.orbax_layout import open_orbax
from .._interop.orbax_reader import lone_item, restore_orbax, restore_orbax_params
from .._interop.orbax_steps import agreed_latest
from .._like import onto_like as _onto_like
from .._like.onto_like import checked_dtype, concrete, retarget
from .._like.transform_rules import compile_transform
from .._manager.checkpointables import BUILTIN_CHECKPOINTABLES
from .._state.train_state import (
    holds_nnx_objects,
    is_nnx,
    nnx_state_as_dict,
    split_state,
    update_in_place,
)
from .._storage.location import Location
from .._storage.store_errors import arguments, refusals

__all__ = ["metadata", "restore", "restore_params"]

# The readers of the kinds that are not pytrees, by the kind the manifest records.
_READERS = {c.kind: c for c in BUILTIN_CHECKPOINTABLES.values() if c.kind != "pytree"}
_READERS[_hf_shards.KIND] = _hf_shards.HFShards(every_steps=1)  # {tensor name: array}


def _reader(item: StepItem) -> Any:
    """The reader of a non-pytree item, as the manager reads it."""
    reader = _READERS.get(item.entry.kind)
    if reader is None:
        raise CheckpointError(
            f"{item.location} is {item.label}, written by a checkpointable of your own: "
            f"read it with CheckpointManager(..., checkpointables={{{item.name!r}: ...}})"
            f".restore(items=({item.name!r},))"
        )
    return reader


# Onto devices of several processes the restore is collective (``region=``).
@public(
    "restore",
    spans=lambda path, like=None, **_: _restore.spans_processes(like),
    errors=refusals(arguments("path")),
)
def restore(
    path: Any,
    like: Any = None,
    *,
    region: _distributed.Region,
    partial: bool = False,
    missing: str = "error",
    transform: Any = None,
    surgery: Any = None,
    dry_run: bool = False,
    memory_limit_bytes: int | None = None,
    cast: str = "safe",
    share_replicated_reads: bool | None = None,
) -> Any:
    """Restores the checkpoint at ``path`` in the form of ``like`` (see ``_core.restore``), or the
    value of a step's JSON item (``DIR/<step>/extras``, ``.../step``, ``.../data_iterator``). NNX
    modules, optimizers and Rngs in ``like`` (alone or in a tuple, list or dict such as ``(model,
    optimizer)``) are restored in place and returned. With no checkpoint of this library at
    ``path``, an Orbax checkpoint there is read (without orbax).

    ``share_replicated_reads``: a leaf ``like`` replicates over several processes is read once in
    all (each reads ``1/P`` of its rows, all-gathered: 3x faster with 2 processes, 9-10x with 4;
    docs/scaling.md). None (default): on with several processes. The same on every process.
    ``memory_limit_bytes``: the host-memory ceiling of the reads in flight beyond the result.

    ``cast="safe"`` (default) casts a leaf to ``like``'s dtype only when no value changes beyond
    float rounding (float32 to bfloat16 rounds; 1e5 to float16, 300 to int8, 16777217 to float32,
    float to int or bool raise StructureError); ``"unsafe"``: numpy's cast.

    Into a changed model: ``partial=True`` leaves out saved leaves ``like`` lacks;
    ``missing="keep"`` keeps ``like``'s value for a leaf the checkpoint lacks (a ShapeDtypeStruct
    there raises, naming it); ``transform`` maps saved leaf paths to ``like``'s (``{regex:
    replacement}`` by ``re.sub`` in order, or ``path -> path | None``; None drops the leaf). Without
    them every difference is listed in one StructureError. ``surgery``: a list of ``fop.Stack``,
    ``Unstack``, ``Fuse``, ``Split``, ``Transpose`` and ``Rename`` operations applied in order to
    the saved leaves (after ``transform``) during the read, each target shard reading only the
    regions it covers. ``dry_run=True`` returns a :class:`~flax_orbax_plugin.RestorePlan` (the saved
    leaves and index ranges making each leaf; ``print`` it) after every check, reading no data.

    Raises:
      CheckpointNotFoundError: nothing at ``path``. NotCommittedError: a save never committed.
      StructureError: ``like`` does not fit (missing or unexpected key, shape, dtype);
        NothingMatchedError (a subclass): no saved leaf matched ``like`` (with ``partial``/
        ``missing``/``transform``); ``missing="keep_all"`` accepts it.
      TransformError: ``transform`` or ``surgery`` is malformed (before anything is read).
      CorruptCheckpointError: a checksum failed or data is missing, naming the leaf;
        ForeignEntryError (a subclass): a symlink or special file in the checkpoint.
      StepDeletedError: the checkpoint was deleted (by retention) while being read.
    """
    request = _restore.read_request(  # every option checked, before any read
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
    return _read_place(Location.from_path(path), like, request)


def _read_place(location: Location, like: Any, request: ReadRequest) -> Any:
    """``fop.restore``: what is at ``location`` classified once, then read by its reader."""
    _host.wait_for_pending_save(location)
    place = _steps.classify(location)
    if place.kind in _steps.PYTREES:
        return update_in_place(like, _restore.restore_with(location, like, request))
    if place.kind == _steps.JSON_ITEM:  # the pytree options are refused, not ignored
        item, opts = place.item, request.changes
        reader = _reader(item)
        given = {"partial": opts.partial, "missing": opts.missing, "transform": opts.transform}
        asked = sorted(k for k, v in given.items() if v not in (None, False, "error"))
        if asked:
            raise CheckpointError(
                f"{item.location} is {item.label}, a JSON value: {', '.join(asked)}= apply "
                f"to pytrees (restore it without them)"
            )
        return reader.restore(item.location, like)
    if place.kind != _steps.ORBAX:
        raise _steps.not_a_checkpoint(place)
    return update_in_place(like, _restore_orbax(location, like, request))


def _restore_orbax(location: Location, like: Any, request: ReadRequest) -> Any:
    """The Orbax checkpoint at ``location``; collective when ``like`` spans processes."""
    region, opts = request.region, request.changes
    if region.spans:
        agree_on_read(location, concrete(like), request)
    if opts.surgery or request.dry_run:
        raise _not_for_orbax(location, "surgery= and dry_run=", "(fop.import_orbax(src, dst))")
    if opts.missing != "error" or opts.transform is not None:
        how = "(fop.import_orbax(src, dst)) and restore the converted step"
        raise _not_for_orbax(location, "missing= and transform=", how)
    step = None
    if _restore.spans_processes(like) and not is_step(location):
        step = agreed_latest(location, region=region)  # every process reads the primary's
    return restore_orbax(location, like, step=step, partial=opts.partial, cast=request.cast)


def _not_for_orbax(where: Any, options: str, how: str) -> CheckpointError:
    return CheckpointError(
        f"{where} is an Orbax checkpoint: {options} apply to this library's checkpoints; "
        f"convert it first {how}"
    )


@public(errors=refusals(arguments("path")))
def metadata(path: Any) -> _layout.CheckpointMetadata:
    """Leaf paths, shapes, dtypes and shardings of a checkpoint; reads no array data.
    On an Orbax checkpoint the error says what it holds and how to read it."""
    location = Location.from_path(path)
    _host.wait_for_pending_save(location)
    place = _steps.classify(location)
    if place.kind in _steps.PYTREES:
        return _restore.metadata(location)
    if place.kind == _steps.JSON_ITEM:  # from the step manifest alone
        item = place.item
        _reader(item)
        return _layout.CheckpointMetadata(
            path=str(item.location),
            format_version=STEP_VERSION,
            created_at=item.manifest.time,
            process_count=item.manifest.process_count,
            leaves={},
            kind=item.entry.kind,
        )
    if place.kind != _steps.ORBAX:
        raise _steps.not_a_checkpoint(place)
    try:  # what the Orbax checkpoint is, and how to read it
        step, items = open_orbax(location)
        what = f"step {step}, " if step is not None else ""
        only = lone_item(location, items)  # not a step of items: its own name is no item's
        what += f"items {sorted(items)}" if only is None else f"one {only.kind} item"
    except (CheckpointError, OSError) as e:
        what = f"unreadable: {e}"
    raise CheckpointNotFoundError(
        f"{location} is an Orbax checkpoint ({what}), not one of this library's (which "
        f"fop.metadata describes): read it with fop.restore(path, like) or "
        f"fop.restore_params, or convert it with fop.import_orbax(path, out_dir)"
    )


logger = logging.getLogger("flax_orbax_plugin")


def _params_like(like: Any) -> Any:
    """The params of ``like`` (a TrainState's, an NNX model's), else ``like`` itself."""
    if like is None or (isinstance(like, Mapping) and not holds_nnx_objects(like)):
        return like
    try:
        items = split_state(like)
    except TypeError:
        return like  # a params pytree of another kind (list, tuple, dataclass leaf tree)
    if "params" in items:
        return items["params"]
    elements = like if isinstance(like, list | tuple) else (like,)
    if not any(is_nnx(x) for x in elements):
        return like  # a flax.struct dataclass of params (no 'params' field): the tree
    raise OptionTypeError(
        f"restore_params(like): expected the model, its params or a training state holding "
        f"them, found {type(like).__name__}, which holds no nnx.Param variables (its items: "
        f"{sorted(items)}); pass the model (or its nnx.eval_shape) or nnx.state(model, nnx.Param)"
    )


def _spans(directory: Any, like: Any = None, *, sharding: Any = None, **_: Any) -> bool:
    """Whether a ``restore_params`` call is collective (data on other processes' devices)."""
    return _restore.spans_processes(_params_like(like), sharding)


_SHARDINGS = (jax.sharding.Sharding, Mapping, list, tuple)


@public("restore-params", spans=_spans, errors=refusals(arguments("directory")))
def restore_params(
    directory: Any,
    like: Any = None,
    *,
    region: _distributed.Region,
    step: int | None = None,
    item: str = "params",
    dtype: Any = None,
    sharding: Any = None,
    partial: bool = False,
    missing: str = "error",
    transform: Any = None,
    surgery: Any = None,
    dry_run: bool = False,
    cast: str = "safe",
    memory_limit_bytes: int | None = None,
) -> Any:
    """Restore only the params of a step (the latest by default), for serving.

    ``item`` names another pytree item to serve instead of ``params`` (``"ema_params"``,
    an EMA copy saved beside them); ``like`` is then that item's tree (or a training
    state whose field of that name is taken).

    Opens nothing but ``<directory>/<step>/params/`` (listing the directory and
    checking each step's manifest exists). ``like`` is a params pytree (arrays or
    ShapeDtypeStructs, e.g. from ``jax.eval_shape``), a TrainState / NNX module
    whose params are taken, or None (numpy on the host). ``dtype`` casts the
    floating-point leaves, over the dtypes ``like`` gives (``cast="safe"``: a value
    that overflows or is not representable is a StructureError naming the leaf;
    ``"unsafe"``: numpy's cast);
    ``sharding`` is one Sharding for every leaf or a pytree of them. Safe to call
    from any thread, even while a manager writes. With several processes and a
    ``like`` or ``sharding`` that spans them, the call is collective and every
    process reads the primary's latest step (one key-value round).

    ``partial``, ``missing`` and ``transform`` restore into changed params, as
    ``fop.restore`` does (paths are within params: ``Dense_0/kernel``); e.g.
    ``partial=True`` with ``like`` a subset of the saved params. ``surgery`` changes
    the layout during the read and ``dry_run=True`` returns the plan instead, as in
    ``fop.restore``. ``memory_limit_bytes``: the host-memory ceiling of the reads in
    flight beyond the params returned, as ``fop.restore`` takes it.
    """
    # each option checked (OptionError naming one) before any read
    check(_restore.SERVING, {"step": step, "item": item, "memory_limit_bytes": memory_limit_bytes})
    changes = _onto_like.changes(
        partial=partial, missing=missing, transform=transform, surgery=surgery
    )
    modes = {"dry_run": dry_run, "cast": cast, "changes": changes}  # each checked here
    request = _restore.read_request(region=region, memory_limit_bytes=memory_limit_bytes, **modes)
    if dtype is not None:
        checked_dtype(dtype)
    if not (sharding is None or isinstance(sharding, _SHARDINGS)):
        raise OptionTypeError(
            f"sharding: expected one jax Sharding or a pytree of them, found "
            f"{type(sharding).__name__} {sharding!r:.60}"
        )
    sharding = concrete(sharding, option="sharding")  # an AbstractMesh's onto set_mesh's
    return _serve(directory, step, _Serving(like, item, dtype, sharding, request))


class _Serving(NamedTuple):
    """``restore_params``' options, checked; ``request``: the read's (its modes)."""

    like: Any
    item: str
    dtype: Any
    sharding: Any
    request: ReadRequest


def _serve(directory: Any, step: int | None, job: _Serving) -> Any:
    """``restore_params``: what is at ``directory``, the step (agreed), then its params."""
    loc = Location.from_path(directory)
    place = _steps.classify(loc, steps_first=True)
    steps = _steps.committed_steps(loc, place.listing)  # (an unreadable step: warned)
    if step is None and _spans(directory, job.like, sharding=job.sharding):
        # the primary's latest step on every process (not two steps in one model)
        op = job.request.region.next_operation_id("serve-step")
        agreed = job.request.region.broadcast_str(op, str(steps[-1]) if steps else "")
        if agreed:
            step = int(agreed)
            steps = steps if step in steps else _steps.committed_steps(loc)
    if not steps:
        if place.kind == _steps.ORBAX:
            return _orbax_params(directory, step, job)
        raise _steps.no_steps(place)  # what is there instead (a step, a run below, ...)

    if step is not None:
        return _serve_step(loc, steps, _steps.choose_step(loc, steps, step), job)
    # past a step the environment shuts
    return _steps.newest_readable(loc, steps, lambda chosen: _serve_step(loc, steps, chosen, job))


def _serve_step(loc: Location, steps: list[int], step: int, job: _Serving) -> Any:
    logger.info("restore_params: step %d of %s", step, loc)  # which step was served
    step_loc = _steps.step_location(loc, step)
    items = _layout.read_manifest(step_loc).items
    entry = _pytree_item(items, job.item, f"step {step} of {loc}", step_loc)
    params_loc = step_loc.child(entry.dir)
    like, placing = job.like, job.dtype is not None or job.sharding is not None
    target = like
    if job.item == "params":
        target = _params_like(like)
    elif not (like is None or isinstance(like, Mapping)):  # a training state: its field
        target = getattr(like, job.item, like)
    if target is None and placing:
        if job.request.dry_run:  # the plan places leaves where like says: it read them all instead
            raise OptionError(
                "dry_run=True with dtype= or sharding= needs like= (the plan says where "
                "each leaf lands): give like=jax.eval_shape(...), or leave them out"
            )
        return _host_then_placed(params_loc, job)
    target, back = nnx_state_as_dict(target)  # an nnx.State like: read as its pure dict
    changes = job.request.changes
    if changes.transform is None and is_nnx(like):
        paths = list(_restore.metadata(params_loc).leaves)
        if paths and all(p.endswith("/value") for p in paths):
            # params saved as an nnx.State (each leaf at <path>/value) into a module's form
            changes = dataclasses.replace(changes, transform=compile_transform({r"/value$": ""}))
    if target is not None and placing:
        target = retarget(target, job.dtype, job.sharding)
    try:
        got = _restore.restore_with(params_loc, target, job.request.replace(changes=changes))
        return got if back is None or job.request.dry_run else back(got)
    except CorruptCheckpointError as e:  # the latest is damaged: the older ones are named
        older = [s for s in steps if s < step][-3:]
        if older:
            e.add_note(f"older steps of {loc}: {older}; restore_params(..., step={older[-1]})")
        raise
    except StructureError as e:  # model.init's output given whole: say so
        if isinstance(target, Mapping) and "params" in target and e.args:
            hint = (
                "like holds a 'params' key at its top (model.init's output?): pass like['params']"
            )
            others = sorted(str(k) for k in target if k != "params" and str(k) in items)
            if others:  # batch_stats ...: items of their own, read by fop.restore
                where = f"fop.restore({str(step_loc)!r} + '/{others[0]}')"
                hint += f"; {others} are items of their own: {where}"
            e.args = (f"{e.args[0]}\n{hint}", *e.args[1:])
        raise


def _pytree_item(items: Mapping, item: str, where: str, step_loc: Location) -> Any:
    """The manifest entry of pytree item ``item``, else an error naming the items there."""
    if item not in items:  # which items there are, and how to read one of them
        raise CheckpointNotFoundError(
            f"{where} holds no {item} item (its items: {sorted(items)}); restore_params(..., "
            f"item=<one of them>) or fop.restore({str(step_loc)!r} + '/<item>') reads one"
        )
    if items[item].kind != "pytree":
        raise CheckpointError(
            f"item {item!r} of {where} is a {items[item].kind} item, not a pytree of "
            f"arrays: fop.restore({str(step_loc)!r} + '/{items[item].dir}') reads it"
        )
    return items[item]


def _orbax_params(directory: Any, step: int | None, job: _Serving) -> Any:
    """The params of the Orbax checkpoint at ``directory`` (none of ours is there)."""
    if job.item != "params":  # the params choice reads Orbax's own layouts (orbax_reader)
        raise CheckpointError(
            f"{directory} is an Orbax checkpoint: item={job.item!r} chooses an item of this "
            f"library's steps; read it with fop.restore('{directory}/<step>/{job.item}')"
        )
    changes, dry_run = job.request.changes, job.request.dry_run
    if changes.keep_missing or changes.transform is not None or changes.surgery or dry_run:
        options = "missing=, transform=, surgery= and dry_run="
        raise _not_for_orbax(directory, options, "with fop.import_orbax(src, dst)")
    like = _params_like(job.like)
    if step is None and _restore.spans_processes(like, job.sharding):
        step = agreed_latest(Location.from_path(directory), region=job.request.region)
    placing = {"dtype": job.dtype, "sharding": job.sharding, "cast": job.request.cast}
    placing["partial"] = changes.partial
    return restore_orbax_params(directory, like, step=step, **placing)


def _host_then_placed(params_loc: Location, job: _Serving) -> Any:
    """Without ``like``: the params read to the host, then cast and placed."""
    request = job.request.replace(cast="safe", dry_run=False)  # as saved: cast after
    host = _restore.restore_with(params_loc, None, request)
    target = retarget(host, job.dtype, job.sharding)
    _onto_like.check_tree(host, target, cast=job.request.cast)  # narrowing rounds; overflow raises

    def placed(x, t):
        if isinstance(t, np.ndarray | np.generic):  # a host leaf (retarget's numpy template)
            return x.astype(t.dtype)
        if not isinstance(t, jax.ShapeDtypeStruct):  # str, bytes, Python scalars: as read
            return x
        x = x.astype(t.dtype)
        return x if t.sharding is None else place(x, t.sharding)

    return jax.tree_util.tree_map(placed, host, target)
