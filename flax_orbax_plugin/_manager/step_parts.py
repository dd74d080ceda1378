"""StepParts: one manager step saved in parts, from several calls, committed once. The
training thread makes every call; with several processes each is collective, in one order.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.step_parts``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from .._base import distributed as _distributed
from .._base import interrupts as _interrupts
from .._base.env import found
from .._core.save import wait_for_data
from .._errors import CheckpointError, OptionTypeError
from .._incremental import reuse as _reuse
from .checkpointables import check_item_name
from .saving import OpenStep, Saver, wait_all

logger = logging.getLogger("flax_orbax_plugin")


def checked_expect(expect: Any) -> tuple[str, ...]:
    """``step_parts``'s ``expect=``: item names (a string is one), each once, at least one."""
    names = (expect,) if isinstance(expect, str) else expect
    if not isinstance(names, Iterable) or isinstance(names, bytes | dict):
        raise OptionTypeError(
            f"step_parts(expect=): expected the item names of the step (a tuple of "
            f"strings), found {found(expect)}"
        )
    names = tuple(names)
    for name in names:
        if not isinstance(name, str):
            raise OptionTypeError(f"step_parts(expect=): expected strings, found {found(name)}")
        check_item_name(name)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CheckpointError(f"step_parts(expect=): {twice} named more than once")
    if not names:
        raise CheckpointError("step_parts(expect=): no item named; expected at least one")
    return names


class _Writing:
    """A part's Pending whose write runs on the step's writer thread (``future``)."""

    def __init__(self, pending: Any, future: concurrent.futures.Future):
        self._pending, self._future = pending, future

    def wait(self) -> Any:
        return self._future.result()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pending, name)


class StepParts:
    """One step saved in parts (see the module docstring), as
    ``CheckpointManager.step_parts`` returns it; a context manager.

    ``saver``: the manager's; ``opened``: the step, begun (``Saver.begin_parts``);
    ``expect``: the item names it commits with; ``region``: the step's collective
    operation; ``finished(blocking)``: called once the commit started (the manager's
    bookkeeping, its wait when saves are synchronous)."""

    def __init__(
        self,
        saver: Saver,
        opened: OpenStep,
        expect: tuple[str, ...],
        region: _distributed.Region,
        *,
        where: str,
        copies: tuple[str, str] | None,
        finished: Callable[[float], None],
    ):
        self._saver, self._opened, self._expect = saver, opened, expect
        self._region, self._where, self._copies = region, where, copies
        self._finished = finished
        self._saved: list[str] = []
        self._metric: dict[str, float | None] | None = None  # from the extras part
        self._blocking = 0.0  # seconds the caller waited, all parts together
        self._state = "open"  # then "committing" or "aborted"
        name = f"fop-parts-{opened.step}"
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    @property
    def step(self) -> int:
        return self._opened.step

    @property
    def expected(self) -> tuple[str, ...]:
        """The item names the step commits with (``expect=``)."""
        return self._expect

    @property
    def saved(self) -> tuple[str, ...]:
        """The parts saved so far, in order."""
        return tuple(self._saved)

    @property
    def missing(self) -> tuple[str, ...]:
        """The expected parts not saved yet."""
        return tuple(n for n in self._expect if n not in self._saved)

    @property
    def open(self) -> bool:
        """True until the last part started the commit, or the step was given up."""
        return self._state == "open"

    def save(self, name: str, value: Any) -> None:
        """Saves item ``name`` of the step (a pytree, the data iterator, a JSON value:
        as the item of that name in ``manager.save``): its blocking phase now (the value
        may be changed or donated on return), its write in the background. The last
        expected part starts the step's commit (in the background, as ``save``; waited
        for with ``async_save=False``). An unknown or repeated name is a CheckpointError
        and changes nothing; any other error gives the step up (its staging removed).
        Training thread; with several processes, on every process, parts in one order."""
        self._check_part(name)
        with self._region.resumed():  # a failure: told to the other processes
            try:
                with self._saver.saving(), _interrupts.deferred_sigint():
                    self._save(name, value)
            except BaseException as e:
                self._give_up(e)
                raise
            if not self.missing:
                self._state = "committing"
                self._writer.shutdown(wait=False)  # no part comes; its writes go on
                metric = self._metric
                if metric is None:
                    metric = self._saver.metric_of(None, self._opened.step)
                self._saver.commit(self._opened, metric, self._blocking)
        if self._state == "committing":
            self._finished(self._blocking)

    def _check_part(self, name: str) -> None:
        what = f"step {self._opened.step} of {self._where}"
        if self._state != "open":
            done = "is committing" if self._state == "committing" else "was given up"
            raise CheckpointError(
                f"step_parts: {what} {done}; part {name!r} not saved (open the step again)"
            )
        if name in self._saved:
            raise CheckpointError(
                f"step_parts: part {name!r} of {what} is saved already (saved: {list(self._saved)})"
            )
        if name not in self._expect:
            raise CheckpointError(
                f"step_parts: {what} expects the parts {list(self._expect)}, not {name!r} "
                f"(still missing: {list(self.missing)})"
            )

    def _save(self, name: str, value: Any) -> None:
        began = time.perf_counter()
        items = {name: value}
        if self._copies is not None and name == self._copies[0]:  # hf_shards' copy too
            items[self._copies[1]] = value
        if name == "extras":
            self._metric = self._saver.metric_of(value, self._opened.step)
        budget = self._saver.budget_of(items)
        pendings = self._saver.save_items(self._opened, items, budget=budget)
        last = None
        for n, pending in pendings.items():
            last = self._writer.submit(pending.wait)
            self._opened.pendings[n] = _Writing(pending, last)
        for pending in pendings.values():  # views under a budget: written before returning
            wait_for_data(getattr(pending, "snap", None), last)
        self._saver.views_held(items, last)  # one writer: the last part's done, all are
        self._saved.append(name)
        self._blocking += time.perf_counter() - began

    def abort(self) -> None:
        """Gives the step up: its writes are cancelled and waited for, what it staged is
        removed (with several processes: left, ours, for the next open or ``gc()``);
        nothing is committed. A no-op once the commit started or the step was given up.
        Training thread; with several processes, on every process."""
        if self._state == "open":
            self._give_up(CheckpointError(f"step {self._opened.step} of {self._where}: aborted"))

    def _give_up(self, error: BaseException) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        opened = self._opened
        opened.request.cancelled.cancel(f"step {opened.step} given up: {error}")
        self._writer.shutdown(wait=True)
        wait_all(opened.pendings.values())  # every write ended (their errors: the step's)
        try:
            _reuse.release(opened.reuses)
        finally:
            self._saver.abort_alone(opened)
            if not (opened.staging.own or _distributed.process_count() == 1):
                logger.warning(
                    "checkpoint: step %d of %s was given up with parts missing; its staging "
                    "%s stays, ours, until the next writer's open or gc() removes it",
                    opened.step,
                    self._where,
                    opened.staging.location,
                )
            self._saver.failed(opened.step, error)

    def __enter__(self) -> StepParts:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._state != "open":
            return
        if exc is not None:  # the block's own error goes on, told to the other processes
            self._give_up(exc)
            if self._region.spans:
                _distributed.publish_failure(self._region, exc)
            return
        error = CheckpointError(
            f"step_parts: the block of step {self._opened.step} of {self._where} ended with "
            f"parts missing: {list(self.missing)} (saved: {list(self._saved)}); nothing was "
            f"committed and what the step staged is removed"
        )
        with self._region.resumed():  # told to the other processes
            self._give_up(error)
            raise error
