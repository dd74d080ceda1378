"""The options of CheckpointManager and CheckpointCallback, each declared once.

Each declaration (``_base.env.Option``) holds the option's name, type, range
or choices, default, one-line doc and the names other libraries give it; the
fields of the public option objects are declared beside them (``policy.FIELDS``,
``retention.FIELDS``, ``tiers.tier_option.FIELDS``) and the manager's shorthands
(``keep=``, ``every_steps=`` ...) are those same declarations. From them come the
constructors' signatures and docstrings, the table in docs/manager.md (tested to
match), the checks and the "did you mean" of an unknown keyword.

``options.check_manager`` and ``options.check_callback`` check every keyword option by
its public name, where it enters (the constructor), before anything is made: a value of
the wrong type, out of range, NaN, infinite, empty or unknown is an
:class:`~flax_orbax_plugin.OptionError` (``OptionTypeError`` for a wrong type) naming
the option, what it takes and what was found. An option given in a mode where it does
nothing (``keep_every=`` when nothing is deleted, any writer's option with
``read_only=True``...) is refused with a message naming both, and so is a shorthand
given with the object that covers it (``keep=`` with ``retention=``). The flat
``persistent_*`` keywords of earlier releases still work, with a DeprecationWarning
naming the ``Tier`` to write instead. The callback checks its ``manager_options``
here too (not when the manager is first made). Declarations and pure converters; any
thread.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Mapping
from typing import Any

from .._base.env import Option, check, found
from .._base.host import HOST_MEMORY
from .._core.formats import MEMORY_LIMIT
from .._format import layout as _layout
from .._format.steps import STEP, STEP_OR_NONE
from .._state.iterators import check_iterator
from . import policy as _policy
from . import retention as _retention
from .checkpointables import kind_of
from .keep_rules import KeepRule
from .save_rules import SaveRule
from .tiers import tier_option as _tier_option
from .tiers.tier_option import Tier

__all__ = [
    "CALLBACK",
    "CALLBACK_HINTS",
    "DEPRECATED",
    "DIRECTORY",
    "HINTS",
    "IMPORT",
    "MANAGER",
    "SAVE_CALL",
    "SHARED_WITH_MANAGER",
    "WRITER_ONLY",
    "check_import",
]


def _name(name: Any, option: str) -> str:
    if not _layout.is_safe_name(name):
        raise ValueError(
            f"invalid item name {name!r} in {option}: use letters, digits, '_', '-', '.' "
            "and do not start with '_' or '.'"
        )
    return name


def _compression(value: Any) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        hint = f" (e.g. {{'params': {value!r}}})" if isinstance(value, str) else ""
        raise TypeError(
            f"expected a dict {{pytree item name: 'zstd' or 'zstd:<level 1-22>'}} or None, "
            f"found {found(value)}{hint}"
        )
    for name, codec in value.items():
        _name(name, "compression")
        _layout.check_codec(codec, where=f"compression[{name!r}]")
    return value


def _checkpointables(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a dict {{item name: Checkpointable}}, found {found(value)}")
    for name, item in value.items():
        _name(name, "checkpointables")
        kind = kind_of(item)  # recorded in the manifest, read back by it
        methods = callable(getattr(item, "save", None)) and callable(getattr(item, "restore", None))
        if not methods or not isinstance(kind, str) or not kind:
            shown = f"kind {found(kind)}" if methods else found(item)
            what = "a Checkpointable (save and restore methods, a non-empty str kind)"
            raise TypeError(f"checkpointables[{name!r}]: expected {what}, found {shown}")
    return value


DIRECTORY = Option(
    "directory", "custom", convert=functools.partial(_tier_option.check_place, "directory")
)
"""The manager's ``directory`` (positional), checked as a tier's path is."""


def _hf_shards(value: Any) -> Any:
    """``hf_shards=``: an ``fop.HFShards(...)`` (an item the manager adds to due steps)."""
    needed = ("every_steps", "item", "name", "due", "save", "restore")
    if not all(hasattr(value, n) for n in needed):
        raise TypeError(f"expected fop.HFShards(every_steps=K, ...) or None, found {found(value)}")
    return value


def _writer(value: Any) -> Any:
    if not callable(getattr(value, "write_scalars", None)):
        raise TypeError(
            f"expected an object with write_scalars(step, scalars), found {found(value)}"
        )
    return value


def _instance(cls: type, name: str, shorthands: str, objects: str) -> Any:
    def convert(value: Any) -> Any:
        if not isinstance(value, cls):
            raise TypeError(
                f"expected a {name}(...) or None (or the shorthands {shorthands}), or {objects}, "
                f"found {found(value)}"
            )
        return value

    return convert


def _tier(value: Any) -> Tier:
    """``persistent=``: a Tier, or a bare path standing for ``Tier(path)``."""
    return value if isinstance(value, Tier) else Tier(value)  # its path checked there


def _mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a dict of CheckpointManager options, found {found(value)}")
    return value


def _flag(name: str, doc: str, *, default: bool = False, aliases: tuple[str, ...] = ()) -> Option:
    return Option(name, "flag", default=default, doc=doc, aliases=aliases)


POLICY_SHORTHANDS = tuple(o.name for o in _policy.FIELDS)
RETENTION_SHORTHANDS = tuple(o.name for o in _retention.FIELDS)

ASYNC_SAVE = _flag(
    "async_save",
    "write in the background; False: save returns once the step is committed",
    default=True,
    aliases=("enable_async_checkpointing", "async_checkpointing", "use_async", "asynchronous"),
)

ON_EVENT = Option(
    "on_event",
    "callable",
    none_ok=True,
    annotation="Callable[[Event], Any]",
    doc='receives each checkpoint event record (docs/manager.md, "Events")',
)

STALL_TIMEOUT = Option(
    "stall_timeout",
    "number",
    none_ok=True,
    low=0,
    low_open=True,
    high=threading.TIMEOUT_MAX,
    expected="a number of seconds > 0 or None",
    doc="seconds a process waited for may make no progress before the wait fails "
    "(several processes; None: FOP_COORDINATION_TIMEOUT_S, 300)",
    aliases=("coordination_timeout", "barrier_timeout"),
)

MANAGER: tuple[Option, ...] = (
    *_retention.FIELDS,
    Option(
        "retention",
        "custom",
        none_ok=True,
        convert=_instance(
            KeepRule,
            "Retention",
            "keep=, keep_every=, keep_best=, best_metric=, best_mode=",
            "a retention rule (fop.KeepLast(n) | fop.KeepEvery(k) | fop.KeepBest(n, metric=) "
            "| fop.KeepFor(seconds))",
        ),
        annotation="Retention | KeepRule",
        doc="which steps to keep, as one object: Retention(...), KeepLast(n), KeepFor(s)...",
    ),
    *_policy.FIELDS,
    Option(
        "policy",
        "custom",
        none_ok=True,
        convert=_instance(
            SaveRule,
            "SavePolicy",
            "every_steps=, every_seconds=, steps=, clock=",
            "a save policy (fop.EverySteps(n) | fop.EverySeconds(t) | fop.OnPreemption() "
            "| fop.InitialSave() | fop.Continuous(...), or fop.Lanes(...))",
        ),
        annotation="SavePolicy | SaveRule | Lanes",
        doc="which steps to save, as one object: SavePolicy(...), EverySteps(n)..., Lanes(...)",
    ),
    ASYNC_SAVE,
    Option(
        "supersede",
        "choice",
        choices=(False, "preemption", True),
        default=False,
        annotation="bool | str",
        doc="a save still writing when the next one starts is cancelled (nothing of it "
        'committed) instead of waited for: True for any newer save, "preemption" for a '
        "preemption save only",
    ),
    _flag("read_only", "take no lock, remove nothing, refuse save (an evaluator's reader)"),
    _flag(
        "handle_sigterm",
        "on SIGTERM the next save saves its step, waits, closes and raises SystemExit(143)",
    ),
    Option(
        "checkpointables",
        "custom",
        none_ok=True,
        convert=_checkpointables,
        annotation="Mapping[str, Checkpointable]",
        doc="the checkpointable used per item name, instead of the built-in",
        aliases=("item_handlers", "handler_registry"),
    ),
    _flag("incremental", "link or server-copy a leaf unchanged since the last step"),
    Option(
        "compression",
        "custom",
        none_ok=True,
        convert=_compression,
        annotation="Mapping[str, str]",
        doc='per pytree item, "zstd" or "zstd:<level>", e.g. {"opt_state": "zstd"}',
    ),
    Option(
        "persistent",
        "custom",
        none_ok=True,
        convert=_tier,
        annotation="Tier | str",
        doc="a persistent tier every committed step is replicated to (Tier(path, ...) or a path)",
    ),
    _flag(
        "reuse_host_buffers",
        "keep one host copy of the state between saves (costs the state's bytes of host "
        "memory for the manager's life; a donating step after a save then never waits for "
        "the write); off (the default): nothing is kept, CPU arrays are held as views and "
        "an accelerator's copy is freed once written",
        default=False,
    ),
    Option(
        "format_version",
        "choice",
        choices=(1, 2),
        none_ok=True,
        annotation="int",
        doc="2 (data files per process: FORMAT.md) or 1 (a file per chunk); None: 2, "
        "or 1 in a directory per host",
    ),
    HOST_MEMORY,
    STALL_TIMEOUT,
    Option(
        "hf_shards",
        "custom",
        none_ok=True,
        convert=_hf_shards,
        annotation="HFShards",
        doc="Hugging Face safetensors shards of params written into every K-th step (HFShards)",
    ),
    ON_EVENT,
)
"""Every keyword option of CheckpointManager, in the order its signature shows them."""

DEPRECATED: tuple[Option, ...] = tuple(
    dataclasses.replace(o, name=f"persistent_{o.name}", doc=f"deprecated: Tier(path, {o.name}=)")
    for o in _tier_option.FIELDS
)
"""The flat ``persistent_<field>`` keywords of earlier releases: a Tier's fields under
those names (taken for one release, with a DeprecationWarning)."""

HINTS: Mapping[str, str] = {
    "best_fn": "keep_best= with best_metric= (a key of the extras you save) and best_mode=",
    "options": (
        "keywords of their own (keep=, every_steps=, every_seconds=, async_save= ...), "
        "not an Orbax CheckpointManagerOptions"
    ),
    "create": "nothing: the directory is created when needed",
}
"""Names users bring from elsewhere that are no single option -> what to write here
(names that are one option are that option's ``aliases``)."""

CALLBACK_HINTS: Mapping[str, str] = {
    **HINTS,
    **{
        f"persistent_{o.name}": f"manager_options={{'persistent': fop.Tier(<path>, {o.name}=...)}}"
        for o in _tier_option.FIELDS
    },
}
"""The callback's hints: the flat tier keywords point to a Tier in its manager_options."""

CALLBACK: tuple[Option, ...] = (
    *(o for o in _policy.FIELDS if o.name in ("every_steps", "every_seconds")),
    dataclasses.replace(_retention.KEEP, default=3),
    Option(
        "resume",
        "choice",
        choices=(False, True, "required"),
        default=False,
        annotation="bool | str",
        doc="False: start fresh (refuse steps there); True: resume the latest good step; "
        '"required": raise when there is none',
    ),
    _flag("overwrite", "with resume=False, remove the steps already there instead of refusing"),
    ASYNC_SAVE,
    Option("state_fn", "callable", none_ok=True, doc="returns the current state (for cb(step, t))"),
    Option(
        "data_iterator",
        "custom",
        none_ok=True,
        convert=check_iterator,
        annotation="Any",
        doc="an iterator whose position is saved with each step",
    ),
    Option(
        "extras_fn",
        "callable",
        none_ok=True,
        doc="extras_fn(step, state) -> dict of small JSON values saved with each step",
    ),
    Option(
        "writer",
        "custom",
        none_ok=True,
        convert=_writer,
        annotation="ScalarWriter",
        doc="an object with write_scalars(step, scalars) receiving each save's figures",
    ),
    ON_EVENT,
    HOST_MEMORY,
    Option(
        "manager_options",
        "custom",
        none_ok=True,
        convert=_mapping,
        annotation="Mapping",
        doc='further CheckpointManager options, e.g. {"persistent": Tier(...)}',
    ),
)
"""Every keyword option of CheckpointCallback."""

SHARED_WITH_MANAGER = ("keep", "every_steps", "every_seconds", "async_save", "on_event")
SHARED_WITH_MANAGER += ("host_memory",)  # its ceiling (_base.host)
"""The callback's options that it hands to its manager."""

WRITER_ONLY = (
    *RETENTION_SHORTHANDS,
    "retention",
    *(n for n in POLICY_SHORTHANDS if n != "clock"),
    "policy",
    "async_save",
    "supersede",
    "incremental",
    "compression",
    "reuse_host_buffers",
    "format_version",
)
"""What a reader never uses: a save's options, retention's."""


SAVE_CALL: tuple[Option, ...] = (
    STEP,
    Option("ignore_policy", "flag", doc="save whatever the save policy says"),
    Option(
        "force", "flag", none_ok=True, expected="True or False", doc="deprecated: ignore_policy="
    ),
    Option("overwrite", "flag"),
    Option("t", "number", none_ok=True, expected="a time in seconds (a finite number) or None"),
)
"""The keyword options of ``CheckpointManager.save`` (and its step)."""


IMPORT: tuple[Option, ...] = (  # fop.import_orbax's / fop.import_msgpack's keyword options
    STEP_OR_NONE,
    Option("force", "flag"),
    Option("format_version", "choice", choices=(1, 2), none_ok=True),
    Option("progress", "callable", none_ok=True),
    MEMORY_LIMIT,  # the host-memory ceiling (_base.host; importing.refuse_over)
)


def check_import(**options: Any) -> dict[str, Any]:  # an importer's, before it reads
    return check(IMPORT, options)
