"""Exceptions raised by flax_orbax_plugin.

Every error that concerns one leaf names its path (``params/Dense_0/kernel``),
what was expected and what was found.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error this package raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing, committed or not, exists at the given path."""


class NotCommittedError(CheckpointError):
    """Something exists at the path but it was never committed (a save died or is running)."""


class StructureError(CheckpointError, ValueError):
    """The tree to save, or the ``like`` template, does not fit: names the leaf path."""


class NothingMatchedError(StructureError):
    """A restore matched no saved leaf to the template (``partial=``, ``missing=``,
    ``transform=`` left nothing to read): names the options and some paths of both
    sides. ``missing="keep_all"`` accepts it, with a warning."""


class TransformError(CheckpointError, ValueError, TypeError):
    """A ``transform=`` option is malformed (a pattern that is no regex, a replacement
    naming a group its pattern lacks, a value of the wrong type): names the entry, what
    was expected and what was found. Raised before anything is read."""


class UnsupportedLocationError(CheckpointError, ValueError):
    """A path argument names no place that argument may be: an unknown ``scheme:``, a
    malformed store URL, or an object store where only local files are supported.
    Names the argument, what it was given and what is supported."""


class CorruptCheckpointError(CheckpointError):
    """Stored data failed its checksum, is missing, or metadata is malformed."""


class ForeignEntryError(CorruptCheckpointError):
    """A symlink or a non-regular file where the library expects one of its own files
    or directories; it is never followed, read, written or removed."""


class StepDeletedError(CheckpointNotFoundError):
    """The checkpoint was removed (by a writer's retention) while it was being read."""


class CoordinationError(CheckpointError):
    """Processes of a multi-process save or restore failed to meet in time."""


class SaveCancelledError(CheckpointError):
    """A save cancelled before it committed (superseded by a newer save or a preemption
    save: ``supersede=``): nothing of it was committed, its staging is removed, earlier
    steps are untouched. With several processes every process raises it for the same
    step (the cancellation is the commit's agreed outcome)."""


class ProcessFailedError(CoordinationError):
    """Another process failed inside the collective operation this one waited in (its
    failure published through the coordination service): names that process, the
    operation and its error."""


class UnknownItemError(CheckpointError, KeyError):
    """An item name that the step does not hold; lists those it does."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DirectoryLockedError(CheckpointError):
    """Another live process (or manager) is already writing to this directory."""


class ReplicationError(CheckpointError):
    """A committed local step could not be copied to the persistent tier (names the
    step, both locations and the cause)."""


class EventHookError(CheckpointError):
    """The ``on_event`` hook of a manager or callback raised: raised again by the next
    ``save``, ``wait`` or ``close`` (the hook's exception is its ``__cause__``, the
    event its ``event``). The checkpoint the event reported on is unaffected."""

    event: object = None


class HookReentryError(CheckpointError, RuntimeError):
    """An ``on_event`` hook (or another callback the library calls on one of its own
    threads) called an operation that would wait for the very thing delivering the
    event (``wait``, ``save``, ``close``, a save handle's ``wait``...): refused, never a
    hang. Names the call, the event and what to do instead; raised in the hook (so
    kept and raised again as an :class:`EventHookError`, its ``__cause__``)."""


class OptionError(CheckpointError, ValueError):
    """An option (a keyword of the public API) or a ``FOP_*`` environment variable with
    a value it does not take, or one that does nothing in the chosen mode: names the
    option, what was expected and what was found."""


class OptionTypeError(OptionError, TypeError):
    """An :class:`OptionError` for a value of the wrong type."""


class StoreAccessError(CheckpointError, ValueError):
    """An object store refused: no such bucket, no credentials could be loaded, or
    access denied. The message names the bucket (``url``), what happened (``reason``)
    and what to do; ``detail`` is the store's own first line. A ``ValueError``, as the
    raw error from tensorstore was."""

    def __init__(self, message: str, *, url: str = "", reason: str = "", detail: str = ""):
        super().__init__(message)
        self.url, self.reason, self.detail = url, reason, detail


class UnsupportedRuntimeError(CheckpointError, RuntimeError):
    """The JAX runtime is one this library does not support (Pathways, the single
    controller): the message names it, why, and what to use instead."""
