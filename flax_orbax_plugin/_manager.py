"""CheckpointManager: a directory of training steps, and restore_params for serving.

Layout::

    <directory>/
      .writer.lock                 flock held by the one live writer (local only)
      <step>/                      committed step
        _CHECKPOINT.json           manifest: format, version, step, {item: kind}
        params/ opt_state/ ...     one core checkpoint (or JSON) per checkpointable
      <step>.partial-<nonce>/      a step being written (local); removed on start
      <step>.deleting-<nonce>/     a step being deleted (local); removed on start

How a step is made atomic. On a local filesystem every item is saved (through
the core, which commits each item on its own) into ``<step>.partial-<nonce>/``;
when all items are durable the manifest is written and fsynced, then the
directory is renamed to ``<step>`` and the parent fsynced. The rename is the
commit. On object stores (no rename) items are written straight into
``<step>/`` and the manifest is written last: it is the commit marker. On both,
:meth:`CheckpointManager.steps` lists only step directories holding a manifest.

Threading and call order. One training thread owns a manager: it calls
``save`` / ``restore`` / ``wait`` / ``close``. ``save`` runs the blocking phase
of each checkpointable on the calling thread (device-to-host snapshot, iterator
state), then hands the rest (background writes, manifest, commit) to one
commit thread; at most one save is in flight, and ``save`` waits for the
previous one before starting another. Retention then runs on a separate
deletion thread, so deleting old steps never blocks training. An error from
the background is re-raised by the next ``save``, ``wait``, ``restore`` or
``close``; it is never dropped.

Multi-process (``jax.process_count() > 1``): every process calls ``save`` and
``restore`` with the same arguments in the same order; each writes its own
shards and its own data-iterator state; process 0 writes the manifest and
commits after a barrier.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flax_orbax_plugin import _distributed, _faults, _save
from flax_orbax_plugin._checkpointables import (
    Checkpointable,
    Pending,
    checkpointable_for,
    read_json,
)
from flax_orbax_plugin._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StructureError,
)
from flax_orbax_plugin._lock import DirectoryLock
from flax_orbax_plugin._policy import SavePolicy
from flax_orbax_plugin._retention import RetentionPolicy, steps_to_delete
from flax_orbax_plugin._storage import Location
from flax_orbax_plugin._train_state import merge_state, split_state

__all__ = ["CheckpointManager", "SaveFigures", "UnknownItemError", "restore_params"]

logger = logging.getLogger(__name__)

MANIFEST = "_CHECKPOINT.json"
FORMAT = "flax_orbax_plugin/step"
VERSION = 1

_STEP_RE = re.compile(r"^[0-9]+$")
_TMP_RE = re.compile(r"^[0-9]+\.(partial|deleting)-[0-9a-z]+$")
_ITEM_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclasses.dataclass(frozen=True)
class SaveFigures:
    """The figures of one committed step, as seen by this process.

    ``blocking_seconds``: how long the training loop waited in ``save``;
    ``total_seconds``: from the start of ``save`` until the step was committed;
    ``bytes_written``: array bytes this process wrote for the step.
    """

    step: int
    blocking_seconds: float
    total_seconds: float
    bytes_written: int

    @property
    def gbytes_per_sec(self) -> float:
        return self.bytes_written / max(self.total_seconds, 1e-9) / 1e9

    def as_scalars(self) -> dict[str, float]:
        return {
            "checkpoint/blocking_seconds": self.blocking_seconds,
            "checkpoint/total_seconds": self.total_seconds,
            "checkpoint/bytes": float(self.bytes_written),
            "checkpoint/gbytes_per_sec": self.gbytes_per_sec,
        }


class UnknownItemError(CheckpointError, KeyError):
    """An item name that the step does not hold; lists those it does."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def _check_item_name(name: Any) -> str:
    if not isinstance(name, str) or not _ITEM_RE.match(name) or ".." in name:
        raise ValueError(
            f"invalid checkpointable name {name!r}: use letters, digits, '_', '-', '.' "
            "and do not start with '_' or '.'"
        )
    return name


def _list_steps(loc: Location) -> list[int]:
    """Committed steps under ``loc`` (integer-named children holding a manifest)."""
    out = []
    for name in loc.list_children():
        if _STEP_RE.match(name) and loc.child(name).exists(MANIFEST):
            out.append(int(name))
    return sorted(out)


def _choose_step(loc: Location, steps: list[int], step: int | None) -> int:
    if not steps:
        raise CheckpointNotFoundError(f"no checkpoints in {loc}")
    if step is None:
        return steps[-1]
    step = operator.index(step)
    if step not in steps:
        raise CheckpointNotFoundError(f"step {step} does not exist in {loc}; steps: {steps}")
    return step


def _read_manifest(step_loc: Location) -> dict[str, Any]:
    data = read_json(step_loc, MANIFEST)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{step_loc}/{MANIFEST} is not a step manifest")
    if not isinstance(data.get("version"), int) or data["version"] > VERSION:
        raise CorruptCheckpointError(
            f"{step_loc}/{MANIFEST} has format version {data.get('version')!r}; "
            f"this library reads up to {VERSION}"
        )
    items = data.get("items")
    if not isinstance(items, dict):
        raise CorruptCheckpointError(f"{step_loc}/{MANIFEST}: 'items' is not an object")
    for name in items:
        try:
            _check_item_name(name)
        except ValueError as e:
            raise CorruptCheckpointError(f"{step_loc}/{MANIFEST}: {e}") from None
    return data


class CheckpointManager:
    """A directory of training steps: save policy, retention, async saves, restore.

    Args (all keyword-only after ``directory``):
      directory: local path, ``s3://`` / ``gs://`` URL, or tensorstore kvstore spec.
      keep: keep the last ``keep`` steps (None: no limit from this rule).
      keep_every: also keep every step divisible by ``keep_every``, forever.
      keep_best, best_metric, best_mode: also keep the ``keep_best`` steps with the
        best ``extras[best_metric]`` ("min" or "max").
      save_every_steps, save_every_seconds, save_steps: the save policy; with
        none of them every ``save`` call writes. ``save(force=True)`` always does.
      async_save: when False, ``save`` returns once the step is committed.
      read_only: take no lock, remove nothing, refuse ``save``; for evaluators
        reading a directory while training writes to it.
      handle_sigterm: on SIGTERM, the next ``save`` call saves its step whatever
        the policy, waits for it, closes the manager and raises SystemExit(143).
        Install from the main thread.
      checkpointables: overrides of the checkpointable used per item name.
      clock: time source for ``save_every_seconds`` (tests pass one in).

    A writer (``read_only=False``) takes an exclusive lock on a local directory
    (a second live writer gets DirectoryLockedError; a SIGKILLed writer's lock is
    released by the kernel) and removes unfinished temporary steps.
    """

    def __init__(
        self,
        directory: Any,
        *,
        keep: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        save_steps: Iterable[int] | None = None,
        async_save: bool = True,
        read_only: bool = False,
        handle_sigterm: bool = False,
        checkpointables: Mapping[str, Checkpointable] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._loc = Location.from_path(directory)
        self._retention = RetentionPolicy(
            keep_last=keep,
            keep_every=keep_every,
            keep_best=keep_best,
            best_metric=best_metric,
            best_mode=best_mode,
        )
        self._policy = SavePolicy(
            every_steps=save_every_steps,
            every_seconds=save_every_seconds,
            steps=save_steps,
            clock=clock,
        )
        self._async = async_save
        self._read_only = read_only
        self._overrides = dict(checkpointables or {})
        self._lock = threading.Lock()  # guards the fields below
        self._reading: collections.Counter[int] = collections.Counter()
        self._deleting: set[int] = set()
        self._metrics: dict[int, float | None] = {}
        self._inflight: Future | None = None
        self._last_save: SaveFigures | None = None
        self._retention_future: Future | None = None
        self._closed = False
        self._preempted = False
        self._prev_sigterm: Any = None
        self._dir_lock: DirectoryLock | None = None
        self._commit_pool: ThreadPoolExecutor | None = None
        self._delete_pool: ThreadPoolExecutor | None = None
        if read_only:
            if handle_sigterm:
                raise ValueError("handle_sigterm needs a writer (read_only=False)")
            return
        if self._loc.is_local and _distributed.is_primary():
            # One writer per directory: the primary holds the lock for all processes
            # of a run (the others write only through the primary's commit protocol).
            os.makedirs(self._loc.path, exist_ok=True)
            self._dir_lock = DirectoryLock(self._loc.path)
            self._dir_lock.acquire()
        try:
            if _distributed.is_primary():
                self._remove_unfinished()
            _distributed.barrier(_distributed.next_operation_id("manager-open"))
        except BaseException:
            self._release_lock()
            raise
        self._commit_pool = ThreadPoolExecutor(1, thread_name_prefix="fop-commit")
        self._delete_pool = ThreadPoolExecutor(1, thread_name_prefix="fop-retention")
        if handle_sigterm:
            if threading.current_thread() is not threading.main_thread():
                self.close()
                raise ValueError("handle_sigterm=True must be set from the main thread")
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # ------------------------------------------------------------------ listing

    @property
    def directory(self) -> str:
        return str(self._loc)

    def steps(self) -> list[int]:
        """Committed steps, ascending (steps being deleted are left out)."""
        steps = _list_steps(self._loc)
        with self._lock:
            return [s for s in steps if s not in self._deleting]

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``handle_sigterm=True``)."""
        return self._preempted

    # ------------------------------------------------------------------ save

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would write (policy, preemption, existing steps)."""
        step = operator.index(step)
        if self._preempted:
            return True
        return self._policy.should_save(step) and step not in self.steps()

    def save(
        self,
        step: int,
        state: Any = None,
        *,
        data_iterator: Any = None,
        extras: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Save ``state`` as ``step`` if the policy says so; return whether it saved.

        ``state`` is split into checkpointables (see ``_train_state``): a Flax
        TrainState, NNX module/optimizer, or a dict of items. ``data_iterator``'s
        state and the JSON ``extras`` become items too. A step that already exists
        is not overwritten unless ``force=True``. Returns once every item's
        blocking phase is done (state may then be mutated or donated); the write
        completes in the background unless ``async_save=False``. Call from the
        training thread only.
        """
        self._check_open()
        if self._read_only:
            raise CheckpointError(f"manager on {self._loc} is read-only")
        step = operator.index(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, found {step}")
        self._raise_background_error()
        preempted = self._preempted
        if not (force or preempted):
            decide = self._policy.should_save(step)
            if self._policy.every_seconds is not None and _distributed.process_count() > 1:
                decide = (
                    _distributed.broadcast_str(
                        _distributed.next_operation_id("manager-policy"), str(int(decide))
                    )
                    == "1"
                )
            if not decide:
                return False
        self._wait_inflight()
        exists = step in self.steps()
        if exists and not (force or preempted):
            return False
        started = time.perf_counter()

        items = split_state(state)
        if data_iterator is not None:
            if "data_iterator" in items:
                raise ValueError("data_iterator given twice: in state and as an argument")
            items["data_iterator"] = data_iterator
        if extras is not None:
            if "extras" in items:
                raise ValueError("extras given twice: in state and as an argument")
            items["extras"] = extras
        if not items:
            raise ValueError("nothing to save: state, data_iterator and extras are all empty")
        for name in items:
            _check_item_name(name)

        nonce = secrets.token_hex(6)
        if _distributed.process_count() > 1:
            nonce = _distributed.broadcast_str(
                _distributed.next_operation_id("manager-nonce"),
                nonce if _distributed.is_primary() else None,
            )
        final = self._loc.child(str(step))
        if self._loc.supports_rename:
            target = self._loc.child(f"{step}.partial-{nonce}")
        else:
            # No rename on object stores: a forced overwrite deletes the old step
            # first (uncommitting it), then writes the new one in its place.
            if exists and _distributed.is_primary():
                self._remove_step_now(step)
            if exists:
                _distributed.barrier(_distributed.next_operation_id("manager-replace"))
            target = final

        handlers = {name: checkpointable_for(name, self._overrides) for name in items}
        pendings: dict[str, Pending] = {}
        try:
            with _save.save_group():  # every item's blocking phase now, writes after
                for name, value in items.items():
                    pendings[name] = handlers[name].save(target.child(name), value)
        except BaseException:
            for p in pendings.values():
                try:
                    p.wait()
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            target.remove()  # nothing committed here: no manifest was written
            raise
        self._policy.record_save()

        metric = None
        if self._retention.best_metric is not None and extras is not None:
            metric = _as_metric(extras.get(self._retention.best_metric))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "items": {name: getattr(h, "kind", "custom") for name, h in handlers.items()},
            "process_count": _distributed.process_count(),
            "time": time.time(),
        }
        op = _distributed.next_operation_id("manager-commit")
        timing = (started, time.perf_counter() - started)
        self._inflight = self._commit_pool.submit(
            self._finish_save, step, target, final, pendings, manifest, metric, op, timing
        )
        if not self._async or preempted:
            self._wait_inflight()
        if preempted:
            self.close()
            raise SystemExit(128 + signal.SIGTERM)
        return True

    def _finish_save(self, step, target, final, pendings, manifest, metric, op, timing) -> None:
        """Commit thread: wait for every item, write the manifest, commit the step."""
        try:
            results = [p.wait() for p in pendings.values()]
            _distributed.barrier(op + "/written")
            if _distributed.is_primary():
                target.write_json(MANIFEST, manifest)  # durable; the commit on object stores
                _faults.kill_point("after_marker")
                if target != final:
                    if final.is_dir():  # force-replacing an existing step
                        old = self._loc.child(f"{step}.deleting-{secrets.token_hex(6)}")
                        final.rename(old)
                        _faults.kill_point("mid_rename")
                        target.rename(final)
                        old.remove()
                    else:
                        target.rename(final)
            _distributed.barrier(op + "/committed")
        except BaseException:
            if target != final and _distributed.is_primary():
                target.remove()
            raise
        started, blocking = timing
        written = sum(r.bytes_written for r in results if isinstance(r, _save.SaveResult))
        with self._lock:
            self._metrics[step] = metric
            self._last_save = SaveFigures(step, blocking, time.perf_counter() - started, written)
        self._retention_future = self._delete_pool.submit(self._apply_retention, step)

    # ------------------------------------------------------------------ retention

    def _metric(self, step: int) -> float | None:
        with self._lock:
            if step in self._metrics:
                return self._metrics[step]
        value = None
        name = self._retention.best_metric
        try:
            step_loc = self._loc.child(str(step))
            if "extras" in _read_manifest(step_loc)["items"]:
                extras = checkpointable_for("extras", self._overrides).restore(
                    step_loc.child("extras"), None
                )
                if isinstance(extras, Mapping):
                    value = _as_metric(extras.get(name))
        except CheckpointError as e:
            logger.warning("retention: cannot read metric of step %d: %s", step, e)
        with self._lock:
            self._metrics[step] = value
        return value

    def gc(self) -> list[int]:
        """Removes unfinished steps and applies retention now; returns the removed steps.

        Call from the training thread (waits for the in-flight save first).
        """
        self._check_open()
        if self._read_only:
            raise CheckpointError(f"manager on {self._loc} is read-only")
        self.wait()
        if _distributed.is_primary():
            self._remove_unfinished()
        return self._apply_retention(None)

    def _apply_retention(self, just_written: int | None) -> list[int]:
        """Deletion thread: delete the steps the retention policy does not keep."""
        removed: list[int] = []
        try:
            if not self._retention.deletes_anything or not _distributed.is_primary():
                return removed
            steps = self.steps()
            metrics = {}
            if self._retention.keep_best is not None:
                metrics = {s: self._metric(s) for s in steps}
                metrics = {s: m for s, m in metrics.items() if m is not None}
            with self._lock:
                protected = {just_written} - {None} | set(+self._reading)
            for s in steps_to_delete(steps, self._retention, metrics=metrics, protected=protected):
                with self._lock:
                    if self._reading[s] > 0:
                        continue
                    self._deleting.add(s)
                try:
                    self._remove_step_now(s)
                    removed.append(s)
                finally:
                    with self._lock:
                        self._deleting.discard(s)
                        self._metrics.pop(s, None)
        except Exception:
            logger.exception("retention failed in %s", self._loc)
        return removed

    def _remove_step_now(self, step: int) -> None:
        loc = self._loc.child(str(step))
        if self._loc.supports_rename:
            doomed = self._loc.child(f"{step}.deleting-{secrets.token_hex(6)}")
            loc.rename(doomed)  # atomic: the step disappears from listings at once
            _faults.kill_point("mid_retention")
            doomed.remove()
        else:
            loc.delete(MANIFEST)  # uncommit first, then delete the data
            _faults.kill_point("mid_retention")
            loc.remove()

    def _remove_unfinished(self) -> None:
        for name in self._loc.list_children():
            if _TMP_RE.match(name):
                logger.info("removing unfinished %s/%s", self._loc, name)
                self._loc.child(name).remove()
            elif _STEP_RE.match(name) and not self._loc.child(name).exists(MANIFEST):
                logger.info("removing uncommitted step %s/%s", self._loc, name)
                self._loc.child(name).remove()

    # ------------------------------------------------------------------ restore

    def restore(
        self,
        like: Any = None,
        *,
        step: int | None = None,
        items: str | Iterable[str] | None = None,
        data_iterator: Any = None,
    ) -> Any:
        """Restore a step (the latest by default).

        * No ``items``: the items of ``like`` (a TrainState, NNX object or dict of
          items) are read and merged into a state of the same kind (static fields
          from ``like``); with ``like=None`` a dict of every item (numpy arrays,
          JSON values) is returned.
        * ``items="params"``: that one item's value; ``items=("params", "extras")``:
          a dict ``{name: value}``. ``like`` then only supplies templates.
        * ``data_iterator``: its state is set to the saved one (this process's).

        ``like`` leaves may be ShapeDtypeStructs (``jax.eval_shape``) with
        shardings: arrays are restored straight onto them. Waits for this
        manager's in-flight save first. A step being read is never deleted by
        this manager's retention.
        """
        self._check_open()
        self._wait_inflight()
        return self._with_step(step, lambda s: self._restore_step(s, like, items, data_iterator))

    def _with_step(self, step: int | None, fn: Callable[[int], Any]) -> Any:
        step = _choose_step(self._loc, self.steps(), step)
        with self._lock:
            if step in self._deleting:
                raise CheckpointNotFoundError(f"step {step} of {self._loc} is being deleted")
            self._reading[step] += 1
        try:
            return fn(step)
        finally:
            with self._lock:
                self._reading[step] -= 1

    def _restore_step(self, step: int, like: Any, items: Any, data_iterator: Any) -> Any:
        step_loc = self._loc.child(str(step))
        saved = _read_manifest(step_loc)["items"]
        like_items = split_state(like) if like is not None else {}
        single = isinstance(items, str)
        if items is not None:
            names = [items] if single else list(items)
            for n in names:
                if n not in saved:
                    raise UnknownItemError(
                        f"step {step} of {self._loc} has no item {n!r}; items: {sorted(saved)}"
                    )
        elif like is not None:
            names = list(like_items)
            for n in names:
                if n not in saved:
                    raise StructureError(
                        f"like has item {n!r} but step {step} of {self._loc} does not; "
                        f"saved items: {sorted(saved)}"
                    )
        else:
            names = [n for n in saved if n != "data_iterator"]
        if data_iterator is not None and "data_iterator" not in saved:
            raise UnknownItemError(
                f"step {step} of {self._loc} holds no data_iterator state; items: {sorted(saved)}"
            )

        restored = {}
        for name in names:
            restored[name] = self._restore_item(step, step_loc, name, like_items.get(name))
        if data_iterator is not None:
            self._restore_item(step, step_loc, "data_iterator", data_iterator)

        if items is not None:
            return restored[names[0]] if single else restored
        return merge_state(like, restored)

    def _restore_item(self, step: int, step_loc: Location, name: str, like: Any) -> Any:
        try:
            return checkpointable_for(name, self._overrides).restore(step_loc.child(name), like)
        except CheckpointError as e:
            e.add_note(f"while restoring item {name!r} of step {step} from {self._loc}")
            raise

    # ------------------------------------------------------------------ lifecycle

    @property
    def save_in_flight(self) -> bool:
        """True while a save's background phase runs (not yet committed or failed)."""
        fut = self._inflight
        return fut is not None and not fut.done()

    @property
    def last_save(self) -> SaveFigures | None:
        """Figures of the most recently committed save of this manager, if any."""
        with self._lock:
            return self._last_save

    def wait(self) -> None:
        """Block until the in-flight save is committed and retention has run.

        With several processes every process must call it (in the same order as save).

        Re-raises a background save error (once).
        """
        self._wait_inflight()
        fut = self._retention_future
        if fut is not None:
            fut.result()
        # Retention runs on the primary only: meet so that every process lists the same
        # steps afterwards (wait is collective, like save, with several processes).
        _distributed.barrier(_distributed.next_operation_id("manager-wait"))

    def close(self) -> None:
        """Wait for the in-flight save, stop the threads, release the lock. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for pool in (self._commit_pool, self._delete_pool):
                if pool is not None:
                    pool.shutdown(wait=True)
            if self._prev_sigterm is not None:
                try:
                    signal.signal(signal.SIGTERM, self._prev_sigterm)
                except ValueError:  # not on the main thread
                    pass
                self._prev_sigterm = None
            self._release_lock()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - do not mask the exception already raised
            logger.exception("error while closing the checkpoint manager")

    def __del__(self):
        try:
            if not self._closed:
                self._release_lock()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ internals

    def _on_sigterm(self, signum, frame) -> None:
        self._preempted = True

    def _release_lock(self) -> None:
        if self._dir_lock is not None:
            self._dir_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"manager on {self._loc} is closed")

    def _raise_background_error(self) -> None:
        fut = self._inflight
        if fut is not None and fut.done() and fut.exception() is not None:
            self._wait_inflight()

    def _wait_inflight(self) -> None:
        fut = self._inflight
        if fut is None:
            return
        try:
            fut.result()
        finally:
            self._inflight = None


def _as_metric(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------- serving


def _params_like(like: Any) -> Any:
    if like is None or isinstance(like, Mapping):
        return like
    try:
        items = split_state(like)
    except TypeError:
        return like  # a params pytree of another kind (list, tuple, dataclass leaf tree)
    if "params" not in items:
        raise TypeError(f"like of type {type(like).__name__} has no params")
    return items["params"]


def _retarget(tree: Any, dtype: Any, sharding: Any) -> Any:
    """ShapeDtypeStructs for ``tree`` with floating leaves cast to ``dtype`` and new shardings."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        shardings = [sharding] * len(leaves)
    else:
        shardings = treedef.flatten_up_to(sharding)
    out = []
    for leaf, sh in zip(leaves, shardings, strict=True):
        dt = leaf.dtype
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(dtype)
        if sh is None:
            sh = getattr(leaf, "sharding", None)
            if sh is not None and not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
                sh = None
        out.append(jax.ShapeDtypeStruct(leaf.shape, dt, sharding=sh))
    return jax.tree_util.tree_unflatten(treedef, out)


def restore_params(
    directory: Any,
    like: Any = None,
    *,
    step: int | None = None,
    dtype: Any = None,
    sharding: Any = None,
) -> Any:
    """Restore only the params of a step (the latest by default), for serving.

    Opens nothing but ``<directory>/<step>/params/`` (listing the directory and
    checking each step's manifest exists). ``like`` is a params pytree (arrays or
    ShapeDtypeStructs, e.g. from ``jax.eval_shape``), a TrainState / NNX module
    whose params are taken, or None (numpy on the host). ``dtype`` casts the
    floating-point leaves; ``sharding`` is one Sharding for every leaf or a pytree
    of them. Safe to call from any thread, even while a manager writes.
    """
    import flax_orbax_plugin as fop

    loc = Location.from_path(directory)
    step = _choose_step(loc, _list_steps(loc), step)
    params_loc = loc.child(str(step)).child("params")
    if not params_loc.is_dir():
        raise CheckpointNotFoundError(f"step {step} of {loc} holds no params")
    target = _params_like(like)
    if target is None and (dtype is not None or sharding is not None):
        import jax

        host = fop.restore(params_loc, None)
        target = _retarget(host, dtype, sharding)
        return jax.tree_util.tree_map(
            lambda x, t: (
                jax.device_put(x.astype(t.dtype), t.sharding)
                if t.sharding is not None
                else x.astype(t.dtype)
            ),
            host,
            target,
        )
    if target is not None and (dtype is not None or sharding is not None):
        target = _retarget(target, dtype, sharding)
    return fop.restore(params_loc, target)
