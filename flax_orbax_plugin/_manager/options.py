"""The options of CheckpointManager and CheckpointCallback, each declared once and
checked once where they enter. Pure functions, on the constructing thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.options``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._base import host_memory as _host_memory
from .._base.env import Option, check, found
from .._base.host_memory import HOST_MEMORY
from .._base.keywords import doc_lines, refuse_unknown, refuse_without, signature, with_defaults
from .._base.shown import outside_stacklevel
from .._core import formats as _formats
from .._core.formats import MEMORY_LIMIT
from .._errors import OptionError
from .._format import layout as _layout
from .._format.steps import STEP, STEP_OR_NONE
from .._state.iterators import check_iterator
from .._storage.location import Location
from . import retention as _retention
from . import save_rules as _save_rules
from .checkpointables import (
    BUILTIN_CHECKPOINTABLES,
    Checkpointable,
    PytreeCheckpointable,
    check_item_name,
    kind_of,
)
from .retention import KeepAny, KeepRule, Lane, Lanes, Retention
from .save_rules import AllOf, AnyOf, SavePolicy, SaveRule
from .tiers import tier as _tiers_tier
from .tiers.tier import Tier


def _compression(value: Any) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        hint = f" (e.g. {{'params': {value!r}}})" if isinstance(value, str) else ""
        raise TypeError(
            f"expected a dict {{pytree item name: 'zstd' or 'zstd:<level 1-22>'}} or None, "
            f"found {found(value)}{hint}"
        )
    for name, codec in value.items():
        check_item_name(name, "compression", ValueError)
        _layout.check_codec(codec, where=f"compression[{name!r}]")
    return value


def _checkpointables(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a dict {{item name: Checkpointable}}, found {found(value)}")
    for name, item in value.items():
        check_item_name(name, "checkpointables", ValueError)
        kind = kind_of(item)  # recorded in the manifest, read back by it
        methods = callable(getattr(item, "save", None)) and callable(getattr(item, "restore", None))
        if not methods or not isinstance(kind, str) or not kind:
            shown = f"kind {found(kind)}" if methods else found(item)
            what = "a Checkpointable (save and restore methods, a non-empty str kind)"
            raise TypeError(f"checkpointables[{name!r}]: expected {what}, found {shown}")
    return value


DIRECTORY = Option(
    "directory", "custom", convert=functools.partial(_tiers_tier.check_place, "directory")
)
"""The manager's ``directory`` (positional), checked as a tier's path is."""


def _hf_shards(value: Any) -> Any:
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
    return value if isinstance(value, Tier) else Tier(value)  # its path checked there


def _mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a dict of CheckpointManager options, found {found(value)}")
    return value


def _object(name: str, convert: Any, annotation: str, doc: str, **more: Any) -> Option:
    return Option(
        name, "custom", none_ok=True, convert=convert, annotation=annotation, doc=doc, **more
    )


def _flag(name: str, doc: str, *, default: bool = False, aliases: tuple[str, ...] = ()) -> Option:
    return Option(name, "flag", default=default, doc=doc, aliases=aliases)


POLICY_SHORTHANDS = tuple(o.name for o in _save_rules.FIELDS)
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
    *_save_rules.FIELDS,
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
    _object(
        "checkpointables",
        _checkpointables,
        "Mapping[str, Checkpointable]",
        "the checkpointable used per item name, instead of the built-in",
        aliases=("item_handlers", "handler_registry"),
    ),
    _flag("incremental", "link or server-copy a leaf unchanged since the last step"),
    _object(
        "compression",
        _compression,
        "Mapping[str, str]",
        'per pytree item, "zstd" or "zstd:<level>", e.g. {"opt_state": "zstd"}',
    ),
    _object(
        "persistent",
        _tier,
        "Tier | str",
        "a persistent tier every committed step is replicated to (Tier(path, ...) or a path)",
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
    _object(
        "hf_shards",
        _hf_shards,
        "HFShards",
        "Hugging Face safetensors shards of params written into every K-th step (HFShards)",
    ),
    ON_EVENT,
)
"""Every keyword option of CheckpointManager, in the order its signature shows them."""

DEPRECATED: tuple[Option, ...] = tuple(
    dataclasses.replace(o, name=f"persistent_{o.name}", doc=f"deprecated: Tier(path, {o.name}=)")
    for o in _tiers_tier.FIELDS
)
"""The deprecated flat ``persistent_<field>`` keywords: a Tier's fields under those names."""

HINTS: Mapping[str, str] = {
    "best_fn": "keep_best= with best_metric= (a key of the extras you save) and best_mode=",
    "options": (
        "keywords of their own (keep=, every_steps=, every_seconds=, async_save= ...), "
        "not an Orbax CheckpointManagerOptions"
    ),
    "create": "nothing: the directory is created when needed",
}
"""Names users bring from elsewhere that are no single option -> what to write here."""

CALLBACK_HINTS: Mapping[str, str] = {
    **HINTS,
    **{
        f"persistent_{o.name}": f"manager_options={{'persistent': fop.Tier(<path>, {o.name}=...)}}"
        for o in _tiers_tier.FIELDS
    },
}
"""The callback's hints: the flat tier keywords point to a Tier in its manager_options."""

CALLBACK: tuple[Option, ...] = (
    *(o for o in _save_rules.FIELDS if o.name in ("every_steps", "every_seconds")),
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
    _object(
        "data_iterator", check_iterator, "Any", "an iterator whose position is saved with each step"
    ),
    Option(
        "extras_fn",
        "callable",
        none_ok=True,
        doc="extras_fn(step, state) -> dict of small JSON values saved with each step",
    ),
    _object(
        "writer",
        _writer,
        "ScalarWriter",
        "an object with write_scalars(step, scalars) receiving each save's figures",
    ),
    ON_EVENT,
    HOST_MEMORY,
    _object(
        "manager_options",
        _mapping,
        "Mapping",
        'further CheckpointManager options, e.g. {"persistent": Tier(...)}',
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


_CLOCK_DEFAULT = _save_rules.CLOCK.default
_GROUPS = (
    ("retention", Retention, RETENTION_SHORTHANDS),
    ("policy", SavePolicy, POLICY_SHORTHANDS),
)


def warn_deprecated(what: str, instead: str) -> None:
    """A deprecated spelling used: DeprecationWarning, at the caller's line."""
    warnings.warn(
        f"{what}: deprecated, and gone in the next release; write {instead}",
        DeprecationWarning,
        stacklevel=outside_stacklevel(),
    )


def _resolve_tier(given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` with its deprecated ``persistent_<field>`` keywords made ``persistent=Tier``."""
    flat = {o.name: given[o.name] for o in DEPRECATED if o.name in given}
    if not flat:
        return dict(given)
    values = check(DEPRECATED, flat)
    fields = {name.removeprefix("persistent_"): v for name, v in values.items()}
    path, names = given.get("persistent"), ", ".join(f"{n}=" for n in flat)
    written = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    if isinstance(path, Tier):  # refused before the warning (it would nest the Tier)
        raise OptionError(
            f"{names} and persistent={path!r} both configure the persistent tier: give "
            f"{written} inside Tier(...) alone"
        )
    shown = "<path>" if path is None else repr(path)
    warn_deprecated(names, f"persistent=fop.Tier({shown}, {written})")
    out = {k: v for k, v in given.items() if k not in flat}
    if path is None:
        defaults = {o.name: o.default for o in DEPRECATED}
        for name, value in values.items():
            needs = "persistent= (the tier it configures)"
            refuse_without(name, value, needs, default=defaults[name])
        return out
    local = Location.from_path(_tiers_tier.PATH.check(path)).is_local
    full = with_defaults(_tiers_tier.FIELDS, fields)
    _tiers_tier.refuse_idle(full, local, name=lambda f: f"persistent_{f}")
    out["persistent"] = Tier(path, **fields)
    return out


def _refuse_both(given: Mapping[str, Any]) -> None:
    """A shorthand given with the object that covers it: OptionError naming both."""
    for option, cls, shorthands in _GROUPS:
        value = given.get(option)
        if value is None:
            continue
        if option == "policy" and not isinstance(value, SavePolicy):
            shorthands = tuple(n for n in shorthands if n != "clock")  # the manager's clock
        if option == "policy" and isinstance(value, Lanes):  # the retention too
            shorthands = shorthands + RETENTION_SHORTHANDS + ("retention",)
        both = [n for n in shorthands if n in given]
        if both:
            named = ", ".join(f"{n}={given[n]!r}" for n in both)
            lanes = isinstance(value, Lanes)
            inside = "each Lane(policy, keep=...)" if lanes else f"{cls.__name__}(...)"
            raise OptionError(
                f"{named} and {option}={given[option]!r} both set the {option}: give "
                f"{', '.join(f'{n}=' for n in both)} inside {inside}, or leave out {option}="
            )


def open_stall(given: Mapping[str, Any]) -> float | None:
    """The open's stall timeout, read before its region is drawn; None where invalid."""
    try:
        return STALL_TIMEOUT.check(given.get("stall_timeout"))
    except (OptionError, TypeError):
        return None


def check_manager(given: Mapping[str, Any]) -> dict[str, Any]:
    """The manager's options ``given`` checked: ``{name: value}``, policies as rule objects."""
    given = _host_memory.take_old_name(given)
    refuse_unknown("CheckpointManager", given, MANAGER + DEPRECATED, hints=HINTS)
    given = _resolve_tier(given)
    _refuse_both(given)
    out = with_defaults(MANAGER, check(MANAGER, given))
    if out["read_only"]:
        defaults = {o.name: o.default for o in MANAGER}
        for name in WRITER_ONLY:
            value = given.get(name, out[name])  # as the user wrote it
            refuse_without(name, value, "a writer (read_only=False)", default=defaults[name])
    _compose(out)
    _formats.refuse_ignored(  # what the chosen format ignores (the format says why)
        out["format_version"], out, lambda name, needs: refuse_without(name, out[name], needs)
    )
    if not out["async_save"]:  # a synchronous save has committed before the next starts
        refuse_without("supersede", out["supersede"], "async_save=True", default=False)
    if out["supersede"] == "preemption" and not out["handle_sigterm"]:
        refuse_without("supersede", "preemption", "handle_sigterm=True", default=False)
    if out["persistent"] is not None and not out["handle_sigterm"]:  # the exit's wait
        grace = out["persistent"].grace_seconds
        refuse_without("Tier(grace_seconds)", grace, "handle_sigterm=True", default=_GRACE)
    _host_memory.refuse_idle(out)
    return out


_GRACE = next(o.default for o in _tiers_tier.FIELDS if o.name == "grace_seconds")


def _compose(out: dict[str, Any]) -> None:
    """``out``'s policy and retention as rule objects (a Lanes is both), and its clock."""
    if isinstance(out["retention"], Lanes):
        raise OptionError(
            f"retention={out['retention']!r}: a Lanes is a save policy and its retention at "
            "once: give it as policy=Lanes(...)"
        )
    if isinstance(out["policy"], Lanes):
        out["retention"] = out["policy"]
    for option, cls, shorthands in _GROUPS:  # the retention first: the policy asks it
        if out[option] is None:
            fields = {n: out[n] for n in shorthands}
            if option == "policy" and out["retention"].uses_time and not out["every_seconds"]:
                del fields["clock"]  # the manager's clock, which dates the steps (KeepFor)
            out[option] = cls(**fields)
    retention: KeepRule = out["retention"]
    if not retention.deletes_anything and not isinstance(retention, Retention | Lanes):
        raise OptionError(
            f"retention={retention!r} deletes nothing (KeepEvery keeps steps beside a rule "
            "that deletes): add KeepLast(n), KeepBest(n, metric=) or KeepFor(seconds)"
        )
    policy: SaveRule = out["policy"]
    if isinstance(policy, SavePolicy):
        if policy.clock is not _CLOCK_DEFAULT:
            out["clock"] = policy.clock
    elif not (policy.uses_time or retention.uses_time):
        refuse_without(
            "clock",
            out["clock"],
            "a policy or retention that uses the time (EverySeconds, Continuous, KeepFor...)",
            default=_CLOCK_DEFAULT,
        )
    out["policy"], out["retention"] = _rules(policy), _rules(retention)


def _rules(value: Any, *, top: bool = True) -> Any:
    """``value`` with each SavePolicy or Retention in it, nested too, made rule objects."""
    if isinstance(value, SavePolicy) and not top and value.clock is not _CLOCK_DEFAULT:
        raise OptionError(
            f"{value!r}: the clock= of a SavePolicy inside another rule or a Lane is not "
            "used (the manager has one clock): give clock= to the manager"
        )
    if isinstance(value, SavePolicy | Retention):
        return value.rule
    if isinstance(value, AnyOf | AllOf):
        return type(value)(*(_rules(p, top=False) for p in value.policies))
    if isinstance(value, KeepAny):
        return KeepAny(*(_rules(r, top=False) for r in value.rules))
    if isinstance(value, Lanes | Lane):
        fields = dataclasses.fields(value)
        parts = {f.name: _rules(getattr(value, f.name), top=False) for f in fields}
        return dataclasses.replace(value, **parts)
    return value


def check_callback(given: Mapping[str, Any], directory: Any) -> tuple[dict, dict]:
    """CheckpointCallback's ``directory`` and options checked: its options, its manager's."""
    inside = ("manager_options", MANAGER)  # its options are the manager's
    refuse_unknown("CheckpointCallback", given, CALLBACK, hints=CALLBACK_HINTS, inside=inside)
    Location.from_path(directory)  # UnsupportedLocationError naming what it found
    out = with_defaults(CALLBACK, check(CALLBACK, given))
    if out["resume"] is not False:
        refuse_without("overwrite", out["overwrite"], "resume=False", default=False)
    inner = dict(out["manager_options"] or {})
    if _host_memory.HOST_MEMORY_BUDGET.name in inner:  # the callback's own, by its old name
        both = {"host_memory": given["host_memory"]} if "host_memory" in given else {}
        inner = _host_memory.take_old_name({**inner, **both}, owner="manager_options: ")
        out["host_memory"] = inner.pop("host_memory")
    refuse_unknown("manager_options: CheckpointManager", inner, MANAGER + DEPRECATED, hints=HINTS)
    if inner.get("read_only") is True:  # a callback saves: its manager is a writer
        raise OptionError(
            "manager_options['read_only']=True: a CheckpointCallback saves, so its manager "
            "writes; read a run with fop.CheckpointManager(directory, read_only=True)"
        )
    for name in SHARED_WITH_MANAGER:
        if name in inner:
            raise OptionError(
                f"manager_options[{name!r}]: {name} is an option of CheckpointCallback "
                f"itself (it would override it there); give {name}= to the callback"
            )
    # The callback's shorthands go to its manager unless manager_options holds their object.
    grouped = {n for option, _, names in _GROUPS if inner.get(option) is not None for n in names}
    shared = {n: out[n] for n in SHARED_WITH_MANAGER if n in given or n not in grouped}
    kwargs = _resolve_tier({**shared, **inner})
    check_manager(kwargs)
    return out, kwargs


def _overrides(
    checkpointables: Mapping[str, Checkpointable] | None,
    compression: Mapping[str, str] | None,
) -> dict[str, Checkpointable]:
    """The checkpointable per item name: ``checkpointables``, then ``compression``'s."""
    overrides = dict(checkpointables or {})
    for name, codec in (compression or {}).items():
        if name in overrides:
            raise OptionError(
                f"compression[{name!r}] does nothing: item {name!r} has its own checkpointable "
                "(checkpointables=), which decides how it is stored"
            )
        builtin = BUILTIN_CHECKPOINTABLES.get(name)  # any other name holds arrays
        if builtin is not None and not isinstance(builtin, PytreeCheckpointable):
            raise OptionError(
                f"compression[{name!r}] does nothing: {name!r} is a JSON item (its value is "
                "JSON, not arrays); compression applies to the items of arrays (params, ...)"
            )
        overrides[name] = PytreeCheckpointable(compression=codec)
    return overrides


@dataclass(frozen=True)
class ManagerOptions:
    """CheckpointManager's keyword options checked once (:meth:`build`); ``tier``: persistent=."""

    location: Location
    policy: SaveRule
    retention: KeepRule
    clock: Callable[[], float]
    tier: Tier | None
    overrides: Mapping[str, Checkpointable]
    async_save: bool
    supersede: bool | str
    read_only: bool
    handle_sigterm: bool
    incremental: bool
    reuse_host_buffers: bool
    format_version: int | None  # None: the default (formats.version_for)
    host_memory: int | str | None  # bytes, "auto" or None (_base.host)
    stall_timeout: float | None
    hf_shards: Any
    on_event: Callable[[Any], Any] | None

    @classmethod
    def build(cls, directory: Any, given: Mapping[str, Any]) -> ManagerOptions:
        """Checks ``given`` (:func:`check_manager`) and ``directory``."""
        values = check_manager(given)
        location = Location.from_path(DIRECTORY.check(directory))
        if values["persistent"] is not None and not location.is_local:  # before any store
            raise OptionError(
                f"with persistent= the manager's directory is the local tier and must be a "
                f"local directory, found {location}; give the bucket as persistent="
            )
        overrides = _overrides(values["checkpointables"], values["compression"])
        hf = values["hf_shards"]
        if hf is not None:  # its item, saved on due steps (Saver) and read as any other
            if hf.name in overrides:
                raise OptionError(
                    f"hf_shards: its item name {hf.name!r} is also given in checkpointables= "
                    f"or compression=; give HFShards(name=) another name"
                )
            overrides[hf.name] = hf
        same = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values}
        return cls(location=location, tier=values["persistent"], overrides=overrides, **same)

    def check_reader(self) -> None:
        """Options that need a writer, refused with ``read_only=True``."""
        if not self.read_only:
            return
        if self.handle_sigterm:
            raise ValueError("handle_sigterm needs a writer (read_only=False)")
        if self.tier is not None:
            raise ValueError(
                "persistent= needs a writer; to read the persistent tier, open it "
                "directly: CheckpointManager(<persistent location>, read_only=True)"
            )


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
    """Sets ``cls.__doc__`` and the signature of ``cls.__init__`` from ``declared``."""
    declared = tuple(declared)
    cls.__doc__ = template.format(options=doc_lines(declared, indent="      "))
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    leading = [inspect.Parameter("self", positional), inspect.Parameter("directory", positional)]
    cls.__init__.__signature__ = signature(leading, declared)
