"""Restorer: reads a step of a manager's directory back, on the training thread, after the
save in flight; :meth:`Restorer.with_step` marks the step as being read (never deleted).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.restoring``.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import warnings
from collections.abc import Callable
from typing import Any

from .._base import distributed as _distributed
from .._base import host_memory as _host_memory
from .._base.shown import outside_stacklevel
from .._core import removing as _removing
from .._core.reads import ReadRequest, step_deleted_or
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
    StructureError,
    UnknownItemError,
)
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import ItemEntry
from .._like import onto_like as _onto_like
from .._state.resume import check_items, item_mismatch, warn_unread
from .._state.train_state import merge_state, split_state
from .._storage.location import Location
from . import per_host as _per_host
from .checkpointables import COPY_KINDS, checkpointable_for, kind_of
from .events import RestoreDone, measure_stored
from .retaining import StepBook

logger = logging.getLogger("flax_orbax_plugin")


class Restorer:
    """Restores steps of the manager's directory as ``opts`` (a ``ManagerOptions``) say."""

    def __init__(self, opts: Any, book: StepBook):
        self._loc = opts.location
        self._ceiling = opts.host_memory  # bytes, "auto" or None (_base.host)
        self._overrides = opts.overrides
        self._book = book
        self._read_only = opts.read_only
        self.restored_step: int | None = None
        self._warned_replay = False  # warned that a resume left the data position out
        self.restored_items: tuple[str, ...] = ()  # the items the step last read holds
        self._read: dict[str, str] = {}  # {item: its directory} the last restore read
        self._tier = "local"  # where the step last restored came from

    def restore(
        self,
        like: Any,
        step: int | None,
        items: Any,
        data_iterator: Any,
        changes: Any,
        region,
        limit: int | None = None,
    ) -> Any:
        """``step`` (None: the latest that restores) as CheckpointManager.restore."""
        started, self._tier = time.perf_counter(), "local"
        ceiling = _host_memory.resolve(self._ceiling)  # "auto": from the memory free now
        if limit is not None:
            ceiling = limit if ceiling is None else min(limit, ceiling)
        result = self._restore(like, step, items, data_iterator, changes, region, ceiling)
        seconds, done = time.perf_counter() - started, self.restored_step
        where = _steps.step_location(self._loc, done)
        files, size = measure_stored(where, self._read.values()) or (None, None)
        args = (self._tier, seconds, tuple(self._read), files, size)
        self._book.events.emit(RestoreDone(done, str(self._loc), *args))
        return result

    def _ensure_local(self, step: int, region: _distributed.Region) -> bool:
        """The tier's copy down of ``step``, noting the tier the step comes from."""
        self._tier = "local" if step in self._book.listed() else "persistent"
        return self._book.tier.ensure_local(step, region)

    def _restore(
        self, like: Any, step: int | None, items: Any, data_iterator: Any, changes, region, ceiling
    ) -> Any:
        tier, own = self._book.tier, self._book.per_host
        request = ReadRequest.of_step(own_copy=own, changes=changes, region=region, ceiling=ceiling)
        fn = lambda s: self._restore_step(s, like, items, data_iterator, request)
        if own:
            return self._restore_per_host(step, fn, region)
        if step is not None:
            if tier is not None:
                self._ensure_local(step, region)
                self._book.forget()  # it may have copied the step here
            return self._agreed(step, fn, region)
        skipped: list[tuple[int, CorruptCheckpointError]] = []
        shut, one = [], _distributed.process_count() == 1  # steps the environment shut
        for candidate in reversed(self.candidates(region)):
            for _ in range(2 if tier is not None else 1):  # local, then persistent
                try:
                    if tier is not None:
                        if not self._ensure_local(candidate, region):
                            break
                        self._book.forget()  # it may have copied the step here
                    return self._agreed(candidate, fn, region)
                except OSError as e:  # a permission, EIO: no damage, nothing set aside
                    if not (_steps.environmental(e) and one):  # (several processes: the
                        raise  # others learn of it as an error only: all raise it)
                    shut.append((candidate, _steps.warn_unreadable(self._loc, candidate, e)))
                    break
                except CorruptCheckpointError as e:
                    skipped.append((candidate, e))
                    if tier is not None and not self._loc.child(str(candidate)).is_dir():
                        break  # the copy down from the persistent tier failed its checks
                    self._set_aside(candidate, e)
        if skipped:
            error = skipped[0][1]  # the latest step's own error, naming its file
            said = "; ".join(f"step {s}: {e}" for s, e in skipped)
            error.add_note(f"no step of {self._loc} restores; skipped: {said}")
            raise error
        if shut:  # every step was shut: the newest one's own error
            raise shut[0][1]
        raise CheckpointNotFoundError(f"no committed steps in {self._loc}")

    def _restore_per_host(
        self, step: int | None, fn: Callable[[int], Any], region: _distributed.Region
    ) -> Any:
        """Each host's own directory (collective; docs/tiers.md): way (a) every host
        reads its own copy; (b) the hosts lacking it get it from peers first; else (c)
        the bucket's step is copied down by every host, then read."""
        tier = self._book.tier
        mine = _per_host.valid_steps(self._loc, self._book.listed(), self._book.run)
        views = region.gather_json("restore-local", mine)
        common = set.intersection(*(set(v) for v in views))
        remote = set(tier.agreed_steps(region) or ())
        target = step if step is not None else max(common | remote, default=None)
        way, errors = "a", []
        if target not in (None, *common) and self._from_peers(target, mine, region):
            common.add(target)
            way = "b"
        if target in common:
            result, errors = self._attempt(target, fn, region)
            if not errors:
                logger.info(
                    "checkpoint: restored step %d from each host's own directory %s (way %s)",
                    target,
                    self._loc,
                    way,
                )
                return result
            logger.warning(
                "checkpoint: step %d does not restore from every host's own directory (%s); "
                "reading the persistent tier %s",
                target,
                "; ".join(errors),
                tier.remote,
            )
            if step is None:
                target = max(remote, default=None)
        elif target is not None:
            logger.info(
                "checkpoint: step %d is not in every host's own directory (all hold: %s); "
                "reading it from %s",
                target,
                sorted(common),
                tier.remote,
            )
        if target is None or target not in remote:
            what = "no step" if target is None else f"step {target}"
            why = f" (on the hosts it failed: {'; '.join(errors)[:2000]})" if errors else ""
            raise CheckpointNotFoundError(
                f"{what} restores from every host's own directory ({self._loc}) or from the "
                f"persistent tier {tier.remote}{why}"
            )
        return self._copied_down(target, fn, region)

    def _copied_down(
        self, target: int, fn: Callable[[int], Any], region: _distributed.Region
    ) -> Any:
        """Way (c): the persistent tier's ``target`` copied down, then read."""
        tier = self._book.tier
        if target in self._book.listed():  # this host's part: the full copy replaces it
            _removing.remove_step(self._loc, target)
            self._book.removed(target)
        tier.ensure_local(target, region)
        self._book.forget()
        self._tier = "persistent"
        result = self.with_step(target, fn)
        logger.info("checkpoint: restored step %d from %s (way c)", target, tier.remote)
        return result

    def _from_peers(self, target: int, mine: list[int], region: _distributed.Region) -> bool:
        """Collective: way (b), ``target`` sent from peers; True when all now hold it."""
        if target in self._book.listed() and target not in mine:  # not this host's
            _removing.remove_step(self._loc, target)  # (an old map): a peer's replaces it
            self._book.removed(target)
        done = _per_host.fetch_from_peers(self._loc, target, self._book.run, target in mine, region)
        self._book.forget()
        return done

    def _attempt(
        self, step: int, fn: Callable[[int], Any], region: _distributed.Region
    ) -> tuple[Any, list[str]]:
        """Collective: every host reads ``step``; this host's result and every host's error."""
        result, error = None, None
        try:
            result = self.with_step(step, fn)
        except CheckpointError as e:
            error = f"{type(e).__name__}: {e}"  # nothing set aside: a host's copy
            # lacking what a changed layout reads looks damaged; way (c) replaces it
        views = region.gather_json("restore-read", error)
        return result, [f"process {p}: {v}" for p, v in enumerate(views) if v is not None]

    def candidates(self, region: _distributed.Region) -> list[int]:
        """Committed steps of both tiers, ascending (a step in both is read locally)."""
        steps = self._book.listed()
        tier = self._book.tier
        if tier is not None:  # None: the store cannot be listed (logged)
            steps = sorted(set(steps) | set(tier.agreed_steps(region) or ()))
        return steps

    def _set_aside(self, step: int, error: Exception) -> None:
        """Moves a step whose verified read proved damage aside (never a foreign entry)."""
        logger.warning("checkpoint: skipping damaged step %d of %s: %s", step, self._loc, error)
        if isinstance(error, ForeignEntryError):
            return
        owner = _distributed.is_primary() or self._book.per_host
        if self._read_only or not owner or not self._loc.supports_rename:
            return
        name = f"{step}.corrupt-{secrets.token_hex(6)}"
        try:
            _steps.step_location(self._loc, step).rename(self._loc.child(name))
            self._book.removed(step)
            logger.warning("checkpoint: moved step %d aside to %s/%s", step, self._loc, name)
        except OSError as e:
            logger.warning("checkpoint: could not move step %d aside: %s", step, e)

    def _agreed(self, step: int, fn: Callable[[int], Any], region: _distributed.Region) -> Any:
        """:meth:`with_step` on every process together: a failure on one is raised on all."""
        if _distributed.process_count() == 1:
            return self.with_step(step, fn)
        result, error = None, None
        try:
            result = self.with_step(step, fn)
        except Exception as e:  # noqa: BLE001  (re-raised by the agreement)
            error = e
        where = f"restore of step {step} of {self._loc}"
        region.agree("restore-step", error, what=where)
        return result

    def with_step(self, step: int, fn: Callable[[int], Any]) -> Any:
        """``fn(step)`` with ``step`` chosen and marked as being read."""
        step = _steps.choose_step(self._loc, self._book.listed(), step)
        self._book.begin_read(step)
        try:
            result = fn(step)
            self.restored_step = step
            return result
        except (CheckpointNotFoundError, CorruptCheckpointError) as e:
            raise step_deleted_or(self._loc, step, e) from e
        finally:
            self._book.end_read(step)

    def _restore_step(
        self, step: int, like: Any, items: Any, data_iterator: Any, request: ReadRequest
    ) -> Any:
        changes = request.changes
        step_loc = _steps.step_location(self._loc, step)
        saved = _layout.read_manifest(step_loc).items
        like_items = split_state(like) if like is not None else {}
        single = isinstance(items, str)
        names = self._names_to_restore(step, saved, items, like, like_items, changes)
        if data_iterator is not None and "data_iterator" not in saved:
            raise UnknownItemError(
                f"step {step} of {self._loc} holds no data_iterator state; items: {sorted(saved)}"
            )
        others = {
            n: (step_loc.child(saved[n].dir), saved[n].kind, like_items.get(n)) for n in names
        }
        restored = {
            n: self._restore_item(step, step_loc, saved[n], n, like_items.get(n), request, others)
            for n in names
        }
        if data_iterator is not None:
            self._restore_item(
                step, step_loc, saved["data_iterator"], "data_iterator", data_iterator, request
            )
        self.restored_items = tuple(saved)
        read = [*names, "data_iterator"] if data_iterator is not None else names
        self._read = {n: saved[n].dir for n in read}
        if items is not None:
            return restored[names[0]] if single else restored
        if not changes.partial:  # an item like lacks: said, not dropped (partial: on purpose)
            held = [n for n, e in saved.items() if e.kind not in COPY_KINDS]  # HF: when named
            warn_unread(step, self._loc, held, names)
        merged = merge_state(like, restored)
        if data_iterator is None and not self._read_only:  # a writer's whole state: a resume
            self.warn_replay(step)
        return merged

    def warn_replay(self, step: int) -> None:
        """Warns once when ``step`` holds a data position that a resume left out."""
        if self._warned_replay or "data_iterator" not in self.restored_items:
            return
        self._warned_replay = True
        warnings.warn(
            f"step {step} of {self._loc} holds a 'data_iterator' item but no data_iterator "
            f"was given: the run reads its data again. Pass data_iterator=it (restore, "
            f"on_train_start), or to start the data afresh name the items to restore "
            f"(restore(items=[...]), on_train_start(state, reset=('data_iterator',)))",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )

    def _names_to_restore(self, step, saved, items, like, like_items, changes) -> list[str]:
        if items is not None:
            names = list(check_items(items))
            for n in names:
                if n not in saved:
                    raise UnknownItemError(
                        f"step {step} of {self._loc} has no item {n!r}; items: {sorted(saved)}"
                    )
            return names
        if like is not None:
            names = list(like_items)
            if changes.keep_missing:  # an item the step lacks keeps like's value
                for n in names:
                    if n not in saved:
                        _onto_like.check_item_keepable(n, like_items[n])
                names = [n for n in names if n in saved]
            if not names:  # every item of like would keep its own value
                held = sorted(n for n in saved if n != "data_iterator")
                where = f"step {step} of {self._loc}"
                _onto_like.check_matched(held, list(like_items), [], changes, where, "item")
            absent = [n for n in names if n not in saved]
            if absent:
                shown = ", ".join(repr(n) for n in absent)
                raise StructureError(
                    f"like has item{'s' if len(absent) > 1 else ''} {shown} but step {step} "
                    f"of {self._loc} does not; saved items: {sorted(saved)}. To keep like's "
                    f"value for {'them' if len(absent) > 1 else 'it'} (a part added to the "
                    f"model), pass missing='keep'"
                )
            return names
        # a copy of another item (HF shards) is read only when named
        return [n for n, e in saved.items() if n != "data_iterator" and e.kind not in COPY_KINDS]

    def _restore_item(
        self,
        step: int,
        step_loc: Location,
        entry: ItemEntry,
        name: str,
        like: Any,
        request: ReadRequest,
        others: Any = None,  # on a mismatch, the items checked too (item_mismatch)
    ) -> Any:
        handler = checkpointable_for(name, self._overrides)
        kind = kind_of(handler)  # as the save recorded it
        if entry.kind != kind:  # a reader for another kind would misread it as damage
            raise CheckpointError(
                f"item {name!r} of step {step} in {self._loc} was saved by a checkpointable "
                f"of kind {entry.kind!r}; this manager reads {name!r} as {kind!r}: "
                f"pass checkpointables={{{name!r}: <the checkpointable that saved it>}} "
                f"(nothing on disk was changed)"
            )
        changes = request.changes
        if changes.surgery and name != "params":  # ops name params' paths: mirrors too
            request = request.replace(changes=dataclasses.replace(changes, surgery_mirrored=True))
        try:
            return handler.restore(step_loc.child(entry.dir), like, request)
        except StructureError as e:
            raise item_mismatch(e, name=name, step=step, location=self._loc, others=others) from e
        except CheckpointError as e:
            e.add_note(f"while restoring item {name!r} of step {step} from {self._loc}")
            raise
