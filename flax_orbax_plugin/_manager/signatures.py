"""The public signatures and docstrings of CheckpointManager and CheckpointCallback.

Both constructors take ``**options``; what ``help()`` and ``inspect.signature`` show is
derived from the one declaration of each option (``options.MANAGER`` / ``CALLBACK``).

Called once per class, at import.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from .._base.env import Option
from .._base.keywords import doc_lines, signature

MANAGER_DOC = """A directory of training steps: save policy, retention, async saves, restore.

    ``CheckpointManager(directory, keep=3, every_steps=1000)``, or with the option
    objects ``CheckpointManager(directory, retention=Retention(keep=3),
    policy=SavePolicy(every_steps=1000), persistent=Tier("gs://b/run", keep=1))``, or
    composed: ``policy=EverySteps(1000) | OnPreemption()``, ``retention=KeepLast(3) |
    KeepBest(2, metric="loss")``, ``policy=Lanes(temporary=Lane(EverySeconds(1800),
    keep=KeepLast(2)), permanent=Lane(EverySteps(10_000)))`` (docs/manager.md).

    The options are keyword-only after ``directory``; each is checked when the manager
    is made, and one that does nothing in the chosen mode is refused (OptionError
    naming it).

    Args:
      directory: local path, ``s3://`` / ``gs://`` URL, or tensorstore kvstore spec.
{options}

    ``keep=``, ``keep_every=``, ``keep_best=``, ``best_metric=`` and ``best_mode=``
    are shorthands of ``retention=Retention(...)``; ``every_steps=``,
    ``every_seconds=``, ``steps=`` and ``clock=`` of ``policy=SavePolicy(...)``; a
    shorthand given with its object is an OptionError naming both. The flat
    ``persistent_keep=``, ``persistent_keep_every=``, ``persistent_every=``,
    ``persistent_grace_seconds=`` and ``persistent_lease_seconds=`` of earlier
    releases still work this release, with a DeprecationWarning: write
    ``persistent=Tier(path, keep=..., keep_every=..., every=..., grace_seconds=...,
    lease_seconds=...)``. Longer texts of some options (``handle_sigterm``,
    ``incremental``, ``reuse_host_buffers``, ``host_memory``): docs/manager.md,
    "Options in depth"; the tier: docs/tiers.md.

    ``wait()``: the local tier, ``persistent.wait()``: the replication, ``close()``:
    both. A writer locks a local directory (a second live writer: DirectoryLockedError)
    and removes unfinished temporary steps; a step or core checkpoint is refused.
    """

CALLBACK_DOC = """Resume at train start, save on a policy, flush at train end.

    The options are keyword-only after ``directory``, checked when the callback is
    made (its ``manager_options`` too).

    Args:
      directory: the checkpoint directory (local path or ``s3://`` / ``gs://`` URL).
{options}

    With neither ``every_steps`` nor ``every_seconds`` every step is saved (the
    manager's default policy); ``on_train_end`` always saves the final step.
    ``resume=True`` on a place holding no step starts fresh with a WARNING naming the
    directory (a mistyped path starts a new run). ``manager_options`` holds further
    :class:`CheckpointManager` options, e.g. ``{{"persistent": Tier("gs://b/run",
    keep=1)}}``: then ``directory`` is the fast local tier and resuming takes the
    newest good step of either tier (a new machine with an empty ``directory`` resumes
    from the bucket); ``{{"retention": Retention(...)}}`` or ``{{"policy":
    SavePolicy(...)}}`` replace the callback's own ``keep`` (or ``every_steps`` /
    ``every_seconds``), which may then not be given too.
    """


def document(cls: type, template: str, declared: Iterable[Option]) -> None:
    """Sets ``cls.__doc__`` (``template`` with its ``{options}`` list) and the signature
    of ``cls.__init__`` (``self``, ``directory``, then every option keyword-only) from
    ``declared``."""
    declared = tuple(declared)
    cls.__doc__ = template.format(options=doc_lines(declared, indent="      "))
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    leading = [inspect.Parameter("self", positional), inspect.Parameter("directory", positional)]
    cls.__init__.__signature__ = signature(leading, declared)
