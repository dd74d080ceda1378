"""How a manager ends: ``close`` (with the other processes), ``leave`` (after an error
ended this process's part of the run: with none of them), and the local shut-down both
end with.

``with CheckpointManager(...) as mngr:`` closes when the block ends, and leaves when an
error leaves it (the others learn at once that this process left, and why, rather than
after the stall timeout: ``_base.failures.announce_leaving``).

Threading: the training thread, as every call of the manager.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

from .._base import distributed as _distributed
from .._base import failures as _failures
from .._base import host as _host
from .._errors import CheckpointError
from . import events as _events

logger = logging.getLogger("flax_orbax_plugin")

# Writers not closed yet: they end when the program ends.
_OPEN: weakref.WeakSet = weakref.WeakSet()


def leave_at_exit(manager: Lifecycle) -> None:
    """``manager`` (a writer) ends when this program ends without closing it, in the
    library's exit hook (``_base.host``: before ``atexit``'s, after the saves still
    running were waited for). One process: a program that ended well closes it, one
    that raised shuts it (threads stopped, lock or lease released); several: it leaves
    the run (the others learn at once that it left, and why)."""
    _OPEN.add(manager)
    _host.at_exit(_host.LEAVE, _leave_all)


def _leave_all() -> bool:
    error = getattr(sys, "last_value", None)  # set by now for an uncaught exception
    alone = _distributed.process_count() == 1
    failed = False
    for manager in list(_OPEN):
        try:
            if alone and error is None:
                _say_copies_left(manager)
                manager.close()
            elif alone and not manager._closed:  # saves finished or cancelled (exits.FINISH)
                manager._shut()
            else:
                manager.leave(error or CheckpointError(_NOT_CLOSED))
        except Exception as e:  # noqa: BLE001  (the program is ending: said, then the next)
            said = f"{type(e).__name__}: {e}"
            print(
                f"flax_orbax_plugin: closing {manager._loc} at exit failed: {said}", file=sys.stderr
            )
            failed = failed or (alone and error is None)  # nobody else reads it: status 1
    return failed


_NOT_CLOSED = "the program ended without closing its CheckpointManager"


def _say_copies_left(manager: Lifecycle) -> None:
    tier = manager._book.tier
    left = [] if tier is None else sorted(tier.pending_steps())
    if left:  # the program does not end at once: said, as for a save still running
        where = f"the persistent tier {tier.remote}"  # type: ignore[union-attr]
        print(
            f"flax_orbax_plugin: the program ends: copying steps {left} to {where}", file=sys.stderr
        )


class Lifecycle:  # the manager's close/leave (its _saver, _book, _retainer, ... and wait)
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The manager's calls that wait for a hook's own thread, refused from its hook."""
        super().__init_subclass__(**kwargs)
        _events.refuse_from_hooks(cls, _events.REFUSED_IN_HOOKS, alone_ok=("restore",))

    def close(self) -> None:
        """Wait for the in-flight save, stop the threads, release the lock. Idempotent.
        With several processes, on every process (it meets them: ``wait``). Closing
        with an error (a save's, or one the others brought to the meeting), this
        process then leaves the run as :meth:`leave` does: one of the others still
        waiting for it in an operation of this manager (a step further on, after the
        processes met the error at different steps) raises at once, naming it. From
        its on_event hook: HookReentryError (``events``), and it stays open."""
        self._close(self.wait)

    def _close(self, meet: Callable[[], None]) -> None:
        """:meth:`close`, meeting the other processes with ``meet`` (the public ``wait``,
        or ``_meet`` in the region of a save that stops the run)."""
        if self._closed:
            return
        self._drop_parts()  # a step open in parts: given up
        try:
            self._book.events.holding(meet)  # a hook's error: raised once closed
            tier = self._book.tier
            if tier is not None:  # after SIGTERM: within the grace period
                grace = tier.grace_seconds if self.preempted else None
                tier.close(grace, raise_errors=not self.preempted)
        except BaseException as e:
            self._shut()
            _failures.announce_leaving(e, scope=self._scope, where=f"the run of {self._loc}")
            raise
        self._shut()
        self._book.events.raise_error()

    def leave(self, error: BaseException) -> None:
        """Closes after ``error`` ended this process's part of the run (what the
        ``with`` block's exit does then): the save in flight ends (committed with the
        others, or its own error logged), then the other processes are told that this
        one left: one waiting for it raises ProcessFailedError naming it and ``error``
        at once. Waits for no other process. Idempotent. From its on_event hook:
        HookReentryError, as :meth:`close`."""
        if self._closed:
            return
        try:
            self._drop_parts()  # a step open in parts: given up
            self._saver.wait()
        except BaseException:  # ``error`` goes on; this one is logged
            logger.exception("checkpoint: the save in flight failed while leaving")
        finally:
            _failures.announce_leaving(error, scope=self._scope, where=f"the run of {self._loc}")
            self._shut()

    def _shut(self, *, refused: bool = False) -> None:
        """Stops the threads and releases the lock; ``refused``: the writer's open failed,
        and the lock file (and directory) it made go too."""
        if self._book.tier is not None:
            self._book.tier.close(0, raise_errors=False)
        self._closed = True
        if self._buffers is not None:
            self._buffers.clear()
        self._retainer.shutdown()
        self._schedule.uninstall()
        if refused and self._book.writer is not None:
            self._book.writer.discard()
        self._release_lock()

    def __enter__(self):
        self._check_open()  # type: ignore[attr-defined]  (a closed manager: said here)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.leave(exc)

    def __del__(self):
        # No module global here: at interpreter exit they may be None already (a manager
        # whose constructor raised, still referenced, printed "Exception ignored").
        try:
            if not getattr(self, "_closed", True):
                self._release_lock()
        except Exception:  # noqa: BLE001  (shutting down: no one to tell)
            pass

    def _release_lock(self) -> None:
        if self._book.writer is not None:
            self._book.writer.release()
