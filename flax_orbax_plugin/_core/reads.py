"""The pieces every read of a restore or ``verify`` uses: reads into fresh host arrays,
the in-order issuing of reads under a memory budget, and the errors a read reports
(damage per leaf, a deleted step, the environment's own failures).
Threading: calling thread only (the reads themselves run on tensorstore's pool and
the chunk reader's threads).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import tensorstore as ts

from .._base import env as _env
from .._base import host as _host
from .._base import liveness as _liveness
from .._errors import CheckpointError, CorruptCheckpointError, StepDeletedError
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import COMMIT_FILE
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .targets import Placer


def deleted_or(location: Location, error: Exception) -> Exception:
    """``error``, or a StepDeletedError when the checkpoint's commit marker is gone (the
    writer's retention removed it while this process was reading)."""
    try:
        if location.exists(COMMIT_FILE) or location.parent.exists(_layout.MANIFEST_FILE):
            return error
    except (CheckpointError, OSError):  # a foreign marker, or unknown: not a deletion
        return error
    deleted = StepDeletedError(
        f"{location} was deleted while it was being read (a writer's retention policy "
        f"removes old steps; restore a newer step, or keep more): {error}"
    )
    deleted.__cause__ = error
    return deleted


def step_deleted_or(directory: Location, step: int, error: Exception) -> Exception:
    """``error``, or a StepDeletedError when ``step`` is no longer a committed step of
    the manager's ``directory`` (another process's retention deleted it while this one
    read it)."""
    try:  # listed afresh: another process may have deleted it
        if isinstance(error, StepDeletedError) or step in _steps.committed_steps(directory):
            return error
    except CheckpointError:
        return error
    return StepDeletedError(
        f"step {step} of {directory} was deleted while it was being read (a writer's "
        f"retention policy removes old steps; restore a newer step, or keep more): {error}"
    )


class ReadInto:
    """A read straight into a new numpy array (tensorstore copies chunk by chunk into it,
    without a second whole-array buffer)."""

    def __init__(self, view, dtype: np.dtype | None = None):
        """``dtype``: the leaf's, where its array stores a stand-in (``DTYPES[...].zarr``)."""
        stored = view.dtype.numpy_dtype
        self.out = _host.empty(view.shape, dtype or stored)  # adopted by jax on CPU
        into = _arrays.as_stored(self.out, stored)
        self.future = ts.array(into, copy=False).write(view)

    def result(self) -> np.ndarray:
        self.future.result()
        return self.out


class Reader:
    """Issues tensorstore reads in order, keeping at most ``limit`` bytes in flight."""

    def __init__(self, limit: int, progress: _liveness.Progress | None = None):
        self.limit = limit
        self.progress = progress or _liveness.Progress()  # the bytes read, and asked for
        # a batch file's leaves at a time: placed while the next files are read
        self.placer = Placer(flush_bytes=min(limit, 16 << 20))
        self.pending: collections.deque = collections.deque()
        self.in_flight = 0

    def submit(self, future, nbytes: int, on_done, on_error) -> None:
        if getattr(future, "deferred", False):  # starts when waited for: holds nothing yet
            nbytes = 0
        self.pending.append((future, nbytes, on_done, on_error))
        self.in_flight += nbytes
        self.progress.total += nbytes
        self.drain(self.limit)

    def drain(self, to: int = 0) -> None:
        while self.pending and (self.in_flight > to or to == 0):  # zero-byte reads too
            future, nbytes, on_done, on_error = self.pending.popleft()
            self.in_flight -= nbytes
            try:
                data = future.result()
                self.progress.done += nbytes
                if self.progress.done == nbytes > 0:  # the first bytes read
                    _env.pause_point("mid_read")  # tests: a slow restore (FOP_PAUSE_AT)
                _env.slow_point("read")  # tests: a slow but progressing read
            except Exception as e:  # noqa: BLE001  (tensorstore: ValueError with a status text)
                raise_environmental(e)
                on_error(e)
                continue
            on_done(data)


def raise_environmental(error: Exception) -> None:
    """Raises the OSError ``error`` stands for when it is no proof of damage (EMFILE,
    EIO, EACCES, a timeout, a refused connection: see ``_arrays.environmental``), so
    that no intact checkpoint is reported (and set aside) as damaged."""
    env = _arrays.environmental(error)
    if env is error:
        raise error
    if env is not None:
        raise env from error


def corrupt(paths: list[str], location: Location, error: Exception) -> CorruptCheckpointError:
    shown = ", ".join(repr(p) for p in paths[:20]) + (" ..." if len(paths) > 20 else "")
    noun = "leaf" if len(paths) == 1 else "leaves"
    error = str(error).split(" [tensorstore_spec=", 1)[0]
    return CorruptCheckpointError(
        f"{noun} {shown} in {location}: stored data is damaged or missing ({error})"
    )


def open_array(spec: dict[str, Any], location: Location, paths: list[str]):
    """Opens a stored array, checking its ``zarr.json`` agrees with the metadata (shape,
    dtype, chunks, codecs); a mismatch names the leaves."""
    return opened(_arrays.open_for_read(spec), location, paths)


def opened(future, location: Location, paths: list[str]):
    try:
        return future.result()
    except ValueError as e:
        raise_environmental(e)
        raise corrupt(paths, location, e) from None
