"""Saver: one step of a manager's directory, from its items to its commit.

``CheckpointManager.save`` calls, in order, on the training thread:
:meth:`Saver.check_new_step`, :func:`collect_items`, then :meth:`Saver.start` (every
item's blocking phase, then one background :class:`SaveHandle` running the step's one
:class:`StepCommit` on every process). At most one save is in flight; its error is
re-raised once, by :meth:`Saver.wait`. A failure removes what this save wrote only.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.saving``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from .._base import distributed as _distributed
from .._base import env as _env
from .._base import host_memory as _host_memory
from .._base import interrupts as _interrupts
from .._base.env import found
from .._core import formats as _formats
from .._core import ownership as _ownership
from .._core import removing as _removing
from .._core import save as _save
from .._core import writer_liveness as _liveness
from .._core.commit_rounds import structure_lines
from .._core.formats import SaveRequest, Written
from .._core.handle import Cancellation, raise_if_cancelled
from .._core.save import SaveHandle, SaveResult, Staging, wait_for_data
from .._errors import CheckpointError, SaveCancelledError, StructureError
from .._format import layout as _layout
from .._format.layout import HOST_FILE, ItemEntry, StepManifest
from .._format.records import LANES, MANIFEST_FILE
from .._incremental import reuse as _reuse
from .._incremental.reuse import Reuse
from .._state.train_state import PLAIN_VALUE_TYPES, split_state
from .._storage.location import Location
from . import per_host as _per_host
from .checkpointables import (
    Checkpointable,
    Pending,
    check_item_name,
    checkpointable_for,
    kind_of,
    with_copy_item,
)
from .events import SaveBlockingDone, SaveCommitted, SaveStarted, measure_stored
from .retaining import RetentionRunner, StepBook

_READ_FIRST = frozenset({"json", "step", "data_iterator"})  # checkpointable kinds read first

logger = logging.getLogger("flax_orbax_plugin")


def collect_items(state: Any, data_iterator: Any, extras: Any) -> dict[str, Any]:
    """The items of one save: ``state``'s, then the data iterator and the extras."""
    plain = type(state) is dict and all(  # a dict of str names to plain values or arrays
        type(k) is str and (type(v) in PLAIN_VALUE_TYPES or isinstance(v, np.ndarray | jax.Array))
        for k, v in state.items()
    )
    items = dict(state) if plain else split_state(state)
    for name, value in (("data_iterator", data_iterator), ("extras", extras)):
        if value is not None:
            if name in items:
                raise StructureError(f"{name} given twice: in state and as an argument")
            items[name] = value
    if not items:
        raise StructureError("nothing to save: state, data_iterator and extras are all empty")
    for name in items:
        check_item_name(name)
    return items


@dataclasses.dataclass
class OpenStep:
    """A step being saved (:meth:`Saver.begin`), and its items so far. Training thread."""

    step: int
    final: Location
    staging: Staging
    replace: bool  # the step exists and is being replaced (overwrite=True)
    request: SaveRequest
    prev_loc: Location | None  # an incremental step's previous step
    started: float  # time.perf_counter() when it began
    dirs: dict[str, str] = dataclasses.field(default_factory=dict)
    handlers: dict[str, Checkpointable] = dataclasses.field(default_factory=dict)
    pendings: dict[str, Pending] = dataclasses.field(default_factory=dict)
    reuses: list[Reuse] = dataclasses.field(default_factory=list)


class Saver:
    """Saves steps into the manager's directory as ``opts`` (a ``ManagerOptions``) say."""

    def __init__(
        self,
        opts: Any,
        book: StepBook,
        retention: RetentionRunner,
        buffers: _host_memory.BufferPool | None,
    ):
        self._loc = opts.location
        self._hf_shards = opts.hf_shards  # an fop.HFShards: its item added to due steps
        self._format_version = opts.format_version  # None: the default (see save)
        self._ceiling = opts.host_memory  # bytes, "auto" or None (_base.host)
        self._overrides = opts.overrides
        self._incremental = opts.incremental
        self._buffers = buffers
        self._book = book
        self._retention = retention
        self.log_level = logging.INFO
        self.inflight: SaveHandle | None = None  # the save in flight, if any
        self._steps: list = []  # zero-copy steps told what each save holds (zero_copy)
        self.starting = False  # in a save's blocking phase (see busy)

    def hold_views(self, step: Any) -> None:
        """From now on saves hold CPU arrays as views, told to ``step`` (a ZeroCopyStep)."""
        if self._buffers is not None:
            self._buffers.clear()  # reserved before (on_train_start): not needed now
        self._buffers = None
        self._steps.append(step)

    # -- the save in flight (training thread)

    @property
    def in_flight(self) -> bool:
        """True while a save's background phase runs (not yet committed or failed)."""
        handle = self.inflight
        return handle is not None and not handle.done()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The training thread's part of a save (:attr:`busy` is ``"blocking"``)."""
        self.starting = True
        try:
            yield
        finally:
            self.starting = False

    @property
    def busy(self) -> str | None:
        """``"blocking"``, ``"writing"`` (to its commit) or None; read by the deletion thread."""
        if self.starting:
            return "blocking"
        return "writing" if self.in_flight else None

    def raise_background_error(self) -> None:
        handle = self.inflight
        if handle is not None and handle.done():
            self.wait()

    def wait(self) -> None:
        """Waits for the save in flight; re-raises its error once (from the hook: no wait)."""
        if self._book.events.delivering() is None:  # a hook's restore: its save waits for it
            handle, self.inflight = self.inflight, None
            if handle is not None:
                handle.settle()

    def supersede(self, step: int) -> bool:
        """Cancels the save in flight for ``step``; returns whether one was. Training
        thread, in place of :meth:`wait`; every process calls it for the same ``step``."""
        handle, self.inflight = self.inflight, None
        if handle is None:
            return False
        if not handle.cancel(reason=f"superseded by step {step}"):
            return False  # committed first
        error = handle.error
        if error is not None and not isinstance(error, SaveCancelledError):
            raise error
        logger.warning(
            "checkpoint: the save to %s was superseded by step %d: cancelled, not committed",
            handle.path,
            step,
        )
        return True

    def _step_dir(self, step: int) -> Location:
        return self._loc.child(_layout.step_dir(step))

    def check_new_step(self, step: int, overwrite: bool, region: _distributed.Region) -> list[int]:
        """Refuses a step at or below the latest unless ``overwrite``, or a place not ours;
        clears a dead save's remains (in ``region``). Returns the committed local steps."""
        local = self._book.known()
        if step not in local or overwrite:  # a foreign entry there is never replaced
            at, replace = self._step_dir(step), step in local
            flags = {"replace": replace, "clear": not replace, "take_empty": False}
            _ownership.prepare_slot(at, what=f"step {step}", **flags, region=region)
        # Steps increase across both tiers (the persistent one as known, not listed).
        tier = self._book.tier
        steps = sorted(set(local) | tier.known_steps()) if tier else local
        if steps and step <= steps[-1] and not overwrite:
            what = "already exists" if step in steps else "is below the latest committed step"
            where = self._loc if steps == local else f"{self._loc} + {tier.remote}"
            raise CheckpointError(
                f"step {step} {what} in {where} (latest: {steps[-1]}); steps must "
                f"increase. Resume from it (manager.restore(), or a callback's "
                f"resume=True), use a new directory, or pass overwrite=True to replace steps"
            )
        return local

    def reserve(self, like: Any) -> int:
        """The host buffers sized and populated for one save like ``like``; bytes allocated."""
        if self._buffers is None:
            return 0
        own = self._book.per_host
        version = _formats.version_for(self._format_version, per_host=own)
        request = SaveRequest(format_version=version, own_copy=own, created_at=0.0 if own else None)
        sizes: list[int] = []
        for name, value in split_state(like).items():
            handler = checkpointable_for(name, self._overrides)
            if hasattr(handler, "pool_sizes"):
                sizes += handler.pool_sizes(value, request)
        return self._buffers.reserve(sizes)

    def start(
        self,
        step: int,
        items: dict,
        extras: Any,
        local: list[int],
        *,
        replicate: bool,
        region: _distributed.Region,
    ) -> None:
        """Blocking phase of every item, then the background commit; ``replicate``: SIGTERM's.
        Training thread; a Ctrl-C is held to the blocking phase's end, then the save cancelled."""
        events = self._book.events
        arrays = {  # the items that hold arrays (JSON items are checked by their save)
            n: v
            for n, v in items.items()
            if kind_of(checkpointable_for(n, self._overrides)) not in _READ_FIRST
        }
        figure, budget = _host_memory.save_budget(self._ceiling, arrays, self._incremental)
        events.emit(SaveStarted(step, str(self._loc), figure, budget is not None))
        try:
            with _interrupts.deferred_sigint() as held:
                pendings = self._start(step, items, extras, local, replicate, region, budget, held)
            for pending in pendings.values():  # views under a budget: written before returning
                wait_for_data(getattr(pending, "snap", None), self.inflight)  # interruptible
            self.views_held(items, self.inflight)
        except BaseException as e:
            handle, self.inflight = self.inflight, None
            if handle is not None:
                handle.abandon()
            else:
                events.save_failed(step, str(self._loc), "blocking", e)
            raise

    def _start(self, step, items, extras, local, replicate, region, budget, held) -> dict:
        if replicate and self._book.tier is not None:
            self._book.tier.force(step)
        if self._hf_shards is not None and self._hf_shards.due(step):
            items = with_copy_item(items, self._hf_shards, step)
        own = self._book.per_host  # each host's own directory: see per_host
        if own and _distributed.process_count() > 1:  # one manifest: the primary's extras
            items = _per_host.with_primary_extras(items, region)
        opened = self.begin(step, local, region, budget)
        metric = self._retention.metric_of(extras, step)  # read before any transfer starts
        try:
            self.save_items(opened, items)
        except BaseException:
            self.abort_alone(opened)
            raise
        marker = _per_host.own_marker(step, self._book.run, items) if own else None
        blocking = time.perf_counter() - opened.started
        self.commit(opened, metric, blocking, host_marker=marker, held=held)
        return opened.pendings

    # -- a step saved in parts (step_parts): what a whole save does above, by piece

    def views_held(self, items: dict, handle: Any) -> None:
        """Tells the zero-copy steps that a blocking phase of ``items`` (``handle``) returned."""
        for zero_copy in self._steps:
            zero_copy.saved(items, handle)

    def budget_of(self, items: dict) -> Any:
        """The host-memory budget one blocking phase of ``items`` streams under (or None)."""
        return _host_memory.save_budget(self._ceiling, items, self._incremental)[1]

    def metric_of(self, extras: Any, step: int) -> dict[str, float | None]:
        """The metrics retention ranks ``step`` by, read from its ``extras``."""
        return self._retention.metric_of(extras, step)

    def copies(self, step: int, names: Any) -> tuple[str, str] | None:
        """``(item, copy)`` where ``hf_shards`` writes ``step``'s ``item`` again, else None."""
        if self._hf_shards is None or not self._hf_shards.due(step):
            return None
        with_copy_item(dict.fromkeys(names), self._hf_shards, step)  # its checks
        return self._hf_shards.item, self._hf_shards.name

    def begin_parts(self, step: int, local: list, region: _distributed.Region) -> OpenStep:
        """:meth:`begin` for a step saved in parts (``step_parts``), its SaveStarted said."""
        figure = _host_memory.resolve(self._ceiling)
        self._book.events.emit(SaveStarted(step, str(self._loc), figure, False))
        return self.begin(step, local, region)

    def failed(self, step: int, error: BaseException) -> None:
        """A step saved in parts ended before its commit (SaveFailed, blocking phase)."""
        self._book.events.save_failed(step, str(self._loc), "blocking", error)

    def begin(
        self, step: int, local: list, region: _distributed.Region, budget: Any = None
    ) -> OpenStep:
        """Opens ``step``'s staging and its request (training thread, in ``region``);
        then :meth:`save_items`, :meth:`commit` (or :meth:`abort_alone`)."""
        started = time.perf_counter()
        final = self._step_dir(step)
        own = self._book.per_host
        staging = Staging.begin(final, region.unique_name(), own=own)
        prev = max((s for s in local if s < step), default=None) if self._incremental else None
        cancelled = Cancellation()  # the items' writes stop once it is set
        request = SaveRequest(  # the step's modes, once: each item gets them as its request
            cancelled=cancelled,
            format_version=_formats.version_for(self._format_version, per_host=own),
            host_memory_budget=budget,
            buffers=self._buffers,
            own_copy=own,
            created_at=_per_host.agreed_time(region) if own else None,
            region=region,
        )
        prev_loc = None if prev is None else self._step_dir(prev)
        return OpenStep(step, final, staging, step in local, request, prev_loc, started)

    def commit(
        self,
        opened: OpenStep,
        metric: dict[str, float | None],
        blocking: float,
        *,
        host_marker: bytes | None = None,
        held: Any = None,
    ) -> None:
        """Every item of ``opened`` is in: its commit starts in the background. Training thread."""
        step, region = opened.step, opened.request.region
        entries = {n: ItemEntry(kind_of(h), opened.dirs[n]) for n, h in opened.handlers.items()}
        pendings = opened.pendings
        kinds = [[n, entries[n].kind, getattr(p, "digest", "")] for n, p in pendings.items()]
        digest = _layout.sha256(_layout.encode(kinds))
        op = region.next_operation_id("manager-commit")
        lane, writer = self._book.lane_of(step), self._book.writer
        commit = StepCommit(
            self._loc, opened, entries, digest, host_marker=host_marker, writer=writer, lane=lane
        )
        background = functools.partial(self._background, commit, op, opened, metric, blocking)
        snaps = [getattr(p, "snap", None) for p in pendings.values()]
        stagings = {str(s.staging) for s in snaps if s is not None} - {"none"}
        staging = "; ".join(sorted(stagings)) or "none"
        self._book.events.emit(SaveBlockingDone(step, str(self._loc), blocking, staging))
        guard = self._book.events.refuse_in_hook  # its wait or cancel from a hook: refused
        cancelled = opened.request.cancelled
        self.inflight = SaveHandle(
            str(opened.final), background, cancelled=cancelled, region=region, guard=guard
        ).start(held=held)

    def save_items(
        self, opened: OpenStep, items: dict, *, budget: Any = None
    ) -> dict[str, Pending]:
        """The blocking phase of each of ``items`` into ``opened``'s staging; their pendings."""
        staging, request = opened.staging, opened.request
        if budget is not None:
            request = request.replace(host_memory_budget=budget)
        handlers = {name: checkpointable_for(name, self._overrides) for name in items}
        # On object stores a replaced step's items go under fresh names (old step intact).
        keep = staging.renames or not opened.replace
        dirs = {n: n if keep else f"{n}.{staging.nonce}" for n in items}
        opened.dirs.update(dirs)
        opened.handlers.update(handlers)
        pendings: dict[str, Pending] = {}
        name = None
        # Small items first: no synchronous read of a device value waits behind the arrays.
        order = sorted(items, key=lambda n: kind_of(handlers[n]) not in _READ_FIRST)
        try:
            for name in order:
                value = items[name]
                item_request = request  # incremental: the same item of the previous step
                if self._incremental and getattr(handlers[name], "incremental", False):
                    # the exchange's name: drawn here, in item order
                    op = request.region.next_operation_id("reuse")
                    reuse = Reuse(opened.prev_loc, name, op)
                    opened.reuses.append(reuse)
                    item_request = request.replace(reuse=reuse)
                target = staging.location.child(dirs[name])
                pending = handlers[name].save(target, value, item_request)
                if not callable(getattr(pending, "wait", None)):
                    raise CheckpointError(
                        f"item {name!r}: {type(handlers[name]).__name__}.save returned "
                        f"{found(pending)}; a checkpointable's save must return a Pending "
                        f"(an object with wait())"
                    )
                pendings[name] = pending
            pendings = {n: pendings[n] for n in items}  # the items' own order again
        except BaseException as e:
            wait_all(pendings.values())
            if isinstance(e, StructureError) and name is not None and e.args:  # its item too
                e.args = (f"item {name!r}: {e.args[0]}", *e.args[1:])
            raise
        opened.pendings.update(pendings)
        return pendings

    def abort_alone(self, opened: OpenStep) -> None:
        """Removes what ``opened`` staged where this process alone writes; else a WARNING."""
        if not (opened.staging.own or _distributed.process_count() == 1):
            return
        try:
            abort_staged(opened.staging, opened.replace, opened.dirs)
        except Exception as e:  # noqa: BLE001  (the refusal is the error)
            logger.warning(
                "checkpoint: a save into %s was refused, and removing what it staged failed "
                "(%s: %s); the next writer's open or gc() removes it",
                opened.staging.final,
                type(e).__name__,
                e,
            )

    def _background(
        self,
        commit: StepCommit,
        op: str,
        opened: OpenStep,
        metric: dict[str, float | None],
        blocking: float,
    ) -> SaveResult:
        """The background phase of :meth:`commit`: the commit, then the bookkeeping."""
        step = opened.step
        try:
            written = commit.run(op, opened.request.region)
        except BaseException as e:
            self._book.forget()
            self._book.events.save_failed(step, str(self._loc), "background", e)
            raise
        finally:  # every process has read every exchanged value by now
            if opened.reuses:  # an incremental item's exchange (none: nothing to release)
                _reuse.release(opened.reuses)
        elapsed = time.perf_counter() - opened.started
        r = SaveResult(
            str(opened.final), blocking, elapsed, written.bytes_written, step, written.bytes_reused
        )
        self._book.committed(step, r, metric)
        files, size = commit.stored or (None, None)
        times = (r.blocking_seconds, r.total_seconds - r.blocking_seconds, r.total_seconds)
        counts = (files, size, r.bytes_written, r.bytes_reused)
        self._book.events.emit(SaveCommitted(step, str(self._loc), "local", *times, *counts))
        logger.log(
            self.log_level,
            "checkpoint: committed step %d: blocking %.4f s, total %.4f s, %d bytes, %.3f GB/s",
            step,
            r.blocking_seconds,
            r.total_seconds,
            r.bytes_written,
            r.gigabytes_per_second,
        )
        tier = self._book.tier
        if tier is not None:
            tier.submit(step)
        self._retention.submit(step)
        return r


def wait_all(pendings: Iterable[Pending], *, raise_first: bool = False) -> list[Any]:
    """Waits for every pending write (even after one failed: none stays in flight)."""
    results, first = [], None
    for p in pendings:
        try:
            results.append(p.wait())
        except BaseException as e:  # noqa: BLE001
            results.append(None)
            first = first or e
    if raise_first and first is not None:
        raise first
    return results


class StepCommit:
    """Commits ``opened`` once written; ``digest``: the structure every process agrees on."""

    def __init__(
        self,
        location: Location,
        opened: OpenStep,
        entries: Mapping[str, ItemEntry],
        digest: str,
        *,
        host_marker: bytes | None = None,
        writer: Any = None,
        lane: str | None = None,
    ):
        self._loc = location
        self._step = opened.step
        self._staging = opened.staging
        self._pendings = opened.pendings
        self._entries = entries
        self._digest = digest
        self._replace = opened.replace  # the step exists and is being replaced
        self._host_marker = host_marker  # each host's own directory: written before the sync
        self._cancelled = opened.request.cancelled  # set: the save was interrupted
        self._writer = writer  # the manager's lock or lease: held still (before_commit)?
        self._lane = lane if lane in LANES else None  # recorded in the manifest (Lanes)
        self._op, self._region = "", _distributed.Region("manager-commit")  # run's, at run
        self._sizes: list[Written] = []  # this process's totals, for the manifest
        self._old_dirs: set[str] = set()  # object stores: the replaced step's item dirs
        # (files, bytes) of the step as stored, where this process committed it; else None.
        self.stored: tuple[int, int | None] | None = None

    def run(self, op: str, region: _distributed.Region) -> Written:
        """Background thread: every item written and durable, then the commit ``op``."""
        staging = self._staging
        if self._replace and not staging.renames and _distributed.is_primary():
            old = _layout.read_manifest(staging.final)
            self._old_dirs = {e.dir for e in old.items.values()}
        self._op, self._region = op, region
        written = _save.commit_collectively(
            op,
            what=f"step {self._step} of {self._loc}",
            step=self._step,
            digest=self._digest,
            write=self._write,
            publish=self._publish,
            abort=self._abort,
            structure=self._structure,
            region=region,
        )
        if self._host_marker is not None and _distributed.process_count() > 1:
            self._commit_own_copies(op)
        return written

    def _structure(self) -> list[str]:
        """The step's items and their leaves in words (``commit_collectively``)."""
        out = []
        for name, pending in self._pendings.items():
            snap = getattr(pending, "snap", None)
            if snap is None:
                out.append(f"{name}: {self._entries[name].kind}")
            else:
                out.extend(f"{name}/{line}" for line in structure_lines(snap.leaves))
        return out

    def _commit_own_copies(self, op: str) -> None:
        """Each host's own directory: every process commits its copy with the primary's manifest."""
        if _distributed.is_primary():
            count = _distributed.process_count()
            reports = {p: self._region.get_from(f"{op}/local", p) for p in range(1, count)}
            failed = [f"process {p}: {r}" for p, r in reports.items() if r != "ok"]
            if failed:
                raise CheckpointError(
                    f"step {self._step} of {self._loc} is committed on process 0 but not "
                    f"in every host's own directory: " + "; ".join(failed)
                )
            return
        raw = self._region.broadcast_str(f"{op}/manifest", None)
        try:  # the primary committed its copy: this host commits its own
            self._staging.publish(MANIFEST_FILE, raw.encode(), replace=True)
            self.stored = measure_stored(self._staging.final)
        except BaseException as e:
            self._region.publish(f"{op}/local", f"{type(e).__name__}: {e}")
            self._abort()
            raise
        self._region.publish(f"{op}/local", "ok")

    def _write(self) -> Written:
        total, files, reused = 0, {}, 0
        results = wait_all(self._pendings.values(), raise_first=True)
        raise_if_cancelled(self._cancelled, f"step {self._step} of {self._loc}")
        for name, result in zip(self._pendings, results, strict=True):
            if result is not None and not isinstance(result, Written):
                raise CheckpointError(
                    f"item {name!r}: Pending.wait() returned {found(result)}; expected "
                    f"fop.Written(bytes_written, files) or None"
                )
            if result is not None:
                total += result.bytes_written
                reused += result.bytes_reused
                d = self._entries[name].dir
                files.update({f"{d}/{f}": h for f, h in result.files.items()})
        if self._host_marker is not None:
            self._check_own_items()
            self._staging.location.write_bytes(HOST_FILE, self._host_marker, durable=False)
        self._staging.location.sync()
        _env.kill_point("after_sync")
        self._sizes.append(Written(total, files, reused))
        return self._sizes[-1]

    def _check_own_items(self) -> None:
        """Each host's own directory: every item wrote something into this host's copy."""
        where = self._staging.location
        empty = [n for n, e in self._entries.items() if not where.child(e.dir).list_children()]
        if empty:
            names = ", ".join(repr(n) for n in sorted(empty))
            raise CheckpointError(
                f"step {self._step} of {self._loc}: checkpointable {names} wrote nothing into "
                f"process {_distributed.process_index()}'s own directory; with a directory per "
                f"host every process must write every item, or use a directory hosts share"
            )

    def _publish(self, files: dict[str, str]) -> None:
        raise_if_cancelled(self._cancelled, f"step {self._step} of {self._loc}")
        count = _distributed.process_count()
        # Sizes only where this process wrote it all (others' totals are not here).
        mine = self._sizes[0] if count == 1 and self._sizes else None
        manifest = StepManifest(
            self._step,
            self._entries,
            files,
            count,
            time.time(),
            self._digest,
            None if mine is None else mine.bytes_written,
            None if mine is None else mine.bytes_reused,
            self._lane,
        )
        staging = self._staging
        raw = manifest.to_bytes()
        if self._host_marker is not None and _distributed.process_count() > 1:
            self._region.broadcast_str(f"{self._op}/manifest", raw.decode())
        if self._writer is not None:  # a lease lost meanwhile: nothing committed
            self._writer.before_commit()
        staging.publish(MANIFEST_FILE, raw, replace=True)
        if not staging.renames and self._old_dirs:
            fresh = {e.dir for e in self._entries.values()}
            _removing.remove_children(  # the replaced step's own item directories
                staging.final, sorted(self._old_dirs - fresh), action="clean up the replaced"
            )
        self.stored = measure_stored(staging.final)

    def _abort(self) -> None:
        abort_staged(self._staging, self._replace, {n: e.dir for n, e in self._entries.items()})


def abort_staged(staging: Staging, replace: bool, dirs: Mapping[str, str]) -> None:
    """Removes what one save staged and nothing else: its staging directory; on object
    stores the new step under this save's claim, or, replacing a step, only the new
    items' fresh ``dirs`` and the claim. Background (abort) or training thread."""
    if staging.renames:
        _removing.remove_staging(staging.location, staging.nonce)
    elif not replace:  # a new step written in place: no manifest, all of it goes
        if _liveness.holds_nonce(staging.final, staging.nonce):  # under its own claim only
            _removing.remove_if_ours(staging.final, what="uncommitted step")
    else:  # the old step stays whole: only the new items' fresh directories go
        fresh = [d for n, d in dirs.items() if d != n]
        _removing.remove_children(staging.final, fresh, action="abort the save into")
        if _liveness.holds_nonce(staging.final, staging.nonce):  # its commit record proves it
            _ownership.unclaim(staging.final)
