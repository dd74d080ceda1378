"""Requests: every mode of one save or one read, as a frozen record handed down explicitly,
and the keyword options of the core's entry points they are built from.

An entry point (``fop.save_async``, ``fop.restore``, a manager's save or restore, the
tier, the importers) checks its options once (:func:`check_save`, :func:`check_restore`,
:func:`check_verify`, :func:`check_serving`: each option declared once, as an
``Option``; each function the entry point's first act, on the caller's thread, before
anything is read, written or waited for) and builds one :class:`SaveRequest` or
:class:`ReadRequest`; from there every layer gets
the request as an argument: the plan, the snapshot, the format's write, the reads,
the claims check and the cast check. No mode is a context variable, a module global
or a flag set on an object after it was built; nor is the collective region the
operation runs in (``_base.regions``): it is the request's ``region``. A manager's
items get theirs through the public ``Checkpointable`` protocol (``save(directory,
value, request)``, ``restore(directory, like, request)``), the built-ins as any other.

Threading: a request never changes; it may be read from any thread.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from .._base import distributed as _distributed
from .._base.host import BufferPool
from .._base.host_memory import HOST_MEMORY_BUDGET
from .._base.option_spec import INT64_MAX, Option, check, refuse_without
from .._errors import OptionError
from .._format import layout as _layout
from .._format.steps import STEP_OR_NONE
from .._like.casting import check_policy
from .._like.transform import Changes
from . import formats as _formats
from .formats import DEFAULT_FORMAT_VERSION

__all__ = [
    "DEFAULT_FORMAT_VERSION",
    "MEMORY_LIMIT",
    "DEFAULT_READ_LIMIT_BYTES",
    "DEFAULT_WRITE_LIMIT_BYTES",
    "ReadRequest",
    "SaveRequest",
    "check_restore",
    "check_save",
    "check_serving",
    "check_verify",
    "read_limit",
]

DEFAULT_WRITE_LIMIT_BYTES = 1 << 30  # bytes of writes in flight, by default
# Reads in flight beyond the restored arrays themselves. Small: reading leaves one
# after another (each with tensorstore's chunk-level parallelism) is as fast as
# reading them all at once on few cores, and keeps peak memory near the result's.
DEFAULT_READ_LIMIT_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """How one pytree is saved (the options of ``fop.save_async``, checked, plus what a
    manager adds per step and item).

    ``format_version``: 2 (data files, the default) or 1 (chunk files), the one place the save's
    format is chosen; ``compression``: a checked codec or None;
    ``memory_limit_bytes``: writes in flight (None: the default, see :attr:`limit`);
    ``host_memory_budget``: host bytes the save may hold beyond the state;
    ``data_file_bytes``: version 2's data file size; ``own_copy``: a host's own
    directory (every process writes all it holds and every JSON file);
    ``created_at``: the document's time (the same on every process for an own copy;
    None: when written); ``reuse``: an ``_incremental.Reuse`` (a manager with
    ``incremental=True``) or None; ``buffers``: a manager's host buffers or None;
    ``cancelled``: set when the save is cancelled (Ctrl-C): its writes stop;
    ``region``: the collective operation the save is part of (``_base.regions``: its
    names are drawn there, its waits look at its failures), or None (one process).
    """

    format_version: int = DEFAULT_FORMAT_VERSION
    compression: str | None = None
    memory_limit_bytes: int | None = None
    host_memory_budget: int | None = None
    data_file_bytes: int | None = None
    own_copy: bool = False
    created_at: float | None = None
    reuse: Any = None
    buffers: BufferPool | None = None
    cancelled: threading.Event | None = None
    region: _distributed.Region | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.own_copy and self.created_at is None:
            raise ValueError("SaveRequest: own_copy needs created_at (the agreed time)")

    @property
    def limit(self) -> int:
        """The bytes of writes in flight, ``memory_limit_bytes`` (default
        ``DEFAULT_WRITE_LIMIT_BYTES``), at most half the host memory budget."""
        limit = self.memory_limit_bytes or DEFAULT_WRITE_LIMIT_BYTES
        budget = self.host_memory_budget
        return limit if budget is None else max(1, min(limit, budget // 2))

    def replace(self, **fields: Any) -> SaveRequest:
        return dataclasses.replace(self, **fields)


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """How one pytree is read (the options of ``fop.restore``, checked, plus what a
    manager adds).

    ``memory_limit_bytes``: reads in flight; ``cast``: ``"safe"`` (no cast that changes
    a value) or ``"unsafe"``; ``share_reads``: processes read a replicated leaf
    together (each its rows, then an all-gather; collective); ``own_copy``: a host's own
    directory (each process reads alone; an array read onto a sharded ``like`` holds
    only this host's chunks, so its claims are not checked against the whole array);
    ``changes``: a restore into a changed model (``partial``, ``missing``,
    ``transform``, ``surgery``); ``dry_run``: return the plan of the read
    (``RestorePlan``), reading no array data; ``region``: the collective operation the
    read is part of (``_base.regions``; its processes agree on what they read), or None
    (one process, or a read one process may make alone).
    """

    memory_limit_bytes: int = DEFAULT_READ_LIMIT_BYTES
    cast: str = "safe"
    share_reads: bool = False
    own_copy: bool = False
    changes: Changes = Changes()
    dry_run: bool = False
    region: _distributed.Region | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        check_policy(self.cast)
        if self.own_copy and self.share_reads:
            raise ValueError("ReadRequest: a host's own copy is read alone (share_reads=False)")

    @classmethod
    def of_step(
        cls,
        *,
        own_copy: bool,
        changes: Changes | None,
        region: _distributed.Region | None,
        ceiling: int | None = None,
    ) -> ReadRequest:
        """The request of a manager step's items, in the manager restore's ``region``:
        each host's own directory is read by each process alone (no collective); else
        replicated leaves are read shared. ``ceiling``: the manager's host-memory ceiling
        in bytes (its reads in flight stay under it: ``read_limit``), or None."""
        share = not own_copy and _distributed.process_count() > 1
        changes = changes or Changes()
        limit = read_limit(ceiling)
        return cls(limit, share_reads=share, own_copy=own_copy, changes=changes, region=region)

    def replace(self, **fields: Any) -> ReadRequest:
        return dataclasses.replace(self, **fields)


def read_limit(ceiling: int | None) -> int:
    """Bytes of reads in flight under a host-memory ``ceiling`` (bytes, or None): the
    default (:data:`DEFAULT_READ_LIMIT_BYTES`), never above the ceiling."""
    return DEFAULT_READ_LIMIT_BYTES if ceiling is None else min(DEFAULT_READ_LIMIT_BYTES, ceiling)


# The host-memory limit of a save's or a read's copies: one declaration for both.
MEMORY_LIMIT = Option(
    "memory_limit_bytes",
    "int",
    none_ok=True,
    low=1,
    high=INT64_MAX,
    expected=f"a positive int <= {INT64_MAX} or None",
)


def _codec(value: Any) -> str | None:
    return _layout.check_codec(value, where="compression")


SAVE: tuple[Option, ...] = (
    Option("force", "flag"),
    MEMORY_LIMIT,
    Option(
        "compression",
        "str",
        none_ok=True,
        convert=_codec,
        expected="None, 'zstd' or 'zstd:<level 1-22>'",
    ),
    # None: the default version, as the manager's format_version=None means
    Option("format_version", "choice", choices=(1, 2), none_ok=True),
    Option(
        "data_file_bytes",
        "int",
        none_ok=True,
        low=1,
        high=INT64_MAX,
        expected=f"a positive int <= {INT64_MAX} or None",
    ),
    HOST_MEMORY_BUDGET,
)


def check_save(**options: Any) -> dict[str, Any]:
    """``fop.save``'s options of :data:`SAVE` given by name, checked; ``{name: checked
    value}``. A value of the wrong type, out of range, NaN, empty or unknown is an
    OptionError naming the option, what it takes and what was found;
    ``data_file_bytes`` with format version 1 (one file per chunk: it does nothing
    there) is refused naming both."""
    out = check(SAVE, options)
    out["format_version"] = _formats.version_for(out["format_version"], per_host=False)
    # What the chosen format ignores is refused (the format says what, and why).
    _formats.refuse_ignored(
        out["format_version"], out, lambda name, needs: refuse_without(name, out[name], needs)
    )
    return out


RESTORE: tuple[Option, ...] = (
    MEMORY_LIMIT,
    Option("share_replicated_reads", "flag", none_ok=True, expected="True, False or None"),
)
VERIFY: tuple[Option, ...] = (STEP_OR_NONE, Option("all_steps", "flag"), MEMORY_LIMIT)
SERVING: tuple[Option, ...] = (STEP_OR_NONE, Option("item", "str"), MEMORY_LIMIT)


def check_restore(**options: Any) -> dict[str, Any]:
    """``fop.restore``'s options of :data:`RESTORE`, checked."""
    return check(RESTORE, options)


def check_verify(**options: Any) -> dict[str, Any]:
    """``fop.verify``'s options, checked; ``step`` with ``all_steps`` refused."""
    out = check(VERIFY, options)
    if out["all_steps"] and out["step"] is not None:
        raise OptionError(
            f"step={out['step']} and all_steps=True conflict: all_steps verifies every "
            "step, step= one of them; give one of the two"
        )
    return out


def check_serving(**options: Any) -> dict[str, Any]:
    """``fop.restore_params``'s options of :data:`SERVING`, checked."""
    return check(SERVING, options)
