"""Options of CheckpointManager and CheckpointCallback, checked when they are made.

Each option is checked by its public name, type and range, as ``option_table``
declares it (``keep="3"`` is an OptionTypeError naming ``keep``, not an error about
an internal field when retention first runs).
A keyword that is not an option gets the one it most likely stands for: the names
of Orbax's ``CheckpointManagerOptions``, of ``flax.training.checkpoints`` and of
earlier versions of this library, then close spellings. :class:`ManagerOptions` is
the manager's options checked once, as one frozen record.

Pure functions; called on the constructing thread.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import OptionError, OptionTypeError
from .._format import layout as _layout
from .._storage.location import Location
from . import option_table as _table
from .checkpointables import Checkpointable, PytreeCheckpointable
from .policy import SavePolicy
from .retention import RetentionPolicy

__all__ = [
    "ManagerOptions",
    "check_callback",
    "check_item_name",
    "check_save_call",
    "check_unknown",
    "keyword_defaults",
    "keyword_names",
]

# Names users bring from elsewhere -> what to write here.
KNOWN_NAMES: Mapping[str, str] = {
    "max_to_keep": "keep=",
    "keep_last": "keep=",
    "keep_last_n": "keep=",
    "num_to_keep": "keep=",
    "keep_period": "keep_every=",
    "keep_every_n_steps": "keep_every=",
    "keep_checkpoint_every_n_steps": "keep_every=",
    "save_interval_steps": "every_steps=",
    "save_every": "every_steps=",
    "save_every_steps": "every_steps=",
    "save_steps": "every_steps=",
    "every_n_steps": "every_steps=",
    "checkpoint_every_steps": "every_steps=",
    "every_secs": "every_seconds=",
    "every_n_secs": "every_seconds=",
    "save_interval_secs": "every_seconds=",
    "save_interval_seconds": "every_seconds=",
    "save_every_seconds": "every_seconds=",
    "save_on_steps": "steps=",
    "save_steps_list": "steps=",
    "enable_async_checkpointing": "async_save=",
    "async_checkpointing": "async_save=",
    "use_async": "async_save=",
    "asynchronous": "async_save=",
    "best_fn": "keep_best= with best_metric= (a key of the extras you save) and best_mode=",
    "best_mode_fn": "best_mode=",
    "metric": "best_metric=",
    "options": (
        "keywords of their own (keep=, every_steps=, every_seconds=, async_save= ...), "
        "not an Orbax CheckpointManagerOptions"
    ),
    "item_handlers": "checkpointables=",
    "handler_registry": "checkpointables=",
    "create": "nothing: the directory is created when needed",
}


def keyword_names(function: Callable) -> tuple[str, ...]:
    """The names of ``function``'s keyword-only parameters (its options), in order."""
    params = inspect.signature(function).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def keyword_defaults(function: Callable) -> dict[str, Any]:
    """``{name: default}`` of ``function``'s keyword-only parameters."""
    params = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def check_unknown(
    owner: str,
    unknown: Mapping[str, Any],
    valid: Iterable[str],
    *,
    elsewhere: tuple[str, Iterable[str]] | None = None,
) -> None:
    """Raises TypeError for keywords that ``owner`` does not take, with a suggestion.

    ``elsewhere``: ``(option, names)``, names ``owner`` takes inside a dict option
    (the callback's ``manager_options``)."""
    if not unknown:
        return
    valid = sorted(valid)
    inner_option, inner = elsewhere if elsewhere is not None else ("", ())
    lines = []
    for name in unknown:
        hint = KNOWN_NAMES.get(name)
        if hint is not None and hint.endswith("=") and hint[:-1] not in valid and inner_option:
            hint = f"{inner_option}={{{hint[:-1]!r}: ...}}"
        if hint is None and name in set(inner):
            hint = f"{inner_option}={{{name!r}: ...}}"
        if hint is None:
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.75)
            hint = f"{close[0]}=" if close else None
        lines.append(
            f"{owner}() got an unexpected keyword argument {name!r}"
            + (f": did you mean {hint}?" if hint else "")
        )
    raise TypeError("; ".join(lines) + f" (its options: {', '.join(valid)})")


def check_callback(
    options: Mapping[str, Any], manager_options: Any, manager_defaults: Mapping[str, Any]
) -> None:
    """CheckpointCallback's options (``option_table``) and its ``manager_options``
    (a dict, each name a manager option, checked with the callback's): OptionError
    (or TypeError for an unknown name) naming the option."""
    if manager_options is not None and not isinstance(manager_options, Mapping):
        raise OptionTypeError(
            f"manager_options must be a dict of CheckpointManager options, found "
            f"{type(manager_options).__name__} {manager_options!r}"
        )
    check_unknown(
        "CheckpointManager (through manager_options)",
        {k: v for k, v in (manager_options or {}).items() if k not in manager_defaults},
        manager_defaults,
    )
    _table.check_callback(options, manager_options, manager_defaults)


check_save_call = _table.check_save_call


def check_item_name(name: Any) -> str:
    """``name`` if it is a safe checkpointable name, else ValueError."""
    if not _layout.is_safe_name(name):
        raise ValueError(
            f"invalid checkpointable name {name!r}: use letters, digits, '_', '-', '.' "
            "and do not start with '_' or '.'"
        )
    return name


class Overrides(dict):
    """The checkpointable per item name; ``pytree``: the one of every other pytree item
    (a manager's ``format_version=2``), or None for the built-in."""

    pytree: Checkpointable | None = None


def _overrides(
    checkpointables: Mapping[str, Checkpointable] | None,
    compression: Mapping[str, str] | None,
    format_version: int = 1,
) -> dict[str, Checkpointable]:
    """The checkpointable per item name: ``checkpointables``, then ``compression``'s."""
    overrides = Overrides(checkpointables or {})
    if format_version != 1:
        overrides.pytree = PytreeCheckpointable(format_version=format_version)
    for name, codec in (compression or {}).items():
        if name in overrides:
            raise OptionError(
                f"compression[{name!r}] does nothing: item {name!r} has its own checkpointable "
                "(checkpointables=), which decides how it is stored"
            )
        overrides[check_item_name(name)] = PytreeCheckpointable(
            compression=_layout.check_codec(codec, where=f"compression[{name!r}]"),
            format_version=format_version,
        )
    return overrides


@dataclass(frozen=True)
class ManagerOptions:
    """CheckpointManager's constructor arguments, checked once (see :meth:`build`).

    The fields are the keyword options of the same names (see CheckpointManager),
    except ``location`` (from ``directory``), ``retention`` (from ``keep``,
    ``keep_every``, ``keep_best``, ``best_metric``, ``best_mode``) and ``overrides``
    (from ``checkpointables`` and ``compression``)."""

    location: Location
    retention: RetentionPolicy
    every_steps: int | None
    every_seconds: float | None
    steps: list[int] | None
    async_save: bool
    read_only: bool
    handle_sigterm: bool
    overrides: Mapping[str, Checkpointable]
    clock: Callable[[], float]
    incremental: bool
    persistent: Any
    persistent_keep: int | None
    persistent_keep_every: int | None
    persistent_every: int
    persistent_grace_seconds: float
    persistent_lease_seconds: float
    reuse_host_buffers: bool
    format_version: int
    host_memory_budget: int | None
    on_event: Callable[[Any], Any] | None

    @classmethod
    def build(
        cls, directory: Any, options: Mapping[str, Any], defaults: Mapping[str, Any]
    ) -> ManagerOptions:
        """Checks ``options`` (every keyword option, by its public name: see
        ``option_table``; ``defaults``: the constructor's) and ``directory``; raises
        OptionError (OptionTypeError: a TypeError) naming the option."""
        options = _table.check_manager({k: options[k] for k in defaults}, defaults)
        steps = options["steps"]
        location = Location.from_path(_table.DIRECTORY.check(directory))
        retention = RetentionPolicy(
            keep_last=options["keep"],
            keep_every=options["keep_every"],
            keep_best=options["keep_best"],
            best_metric=options["best_metric"],
            best_mode=options["best_mode"],
        )
        overrides = _overrides(
            options["checkpointables"], options["compression"], options["format_version"]
        )
        plain = {k: options[k] for k in _PLAIN}
        return cls(location, retention, steps=steps, overrides=overrides, **plain)

    def save_policy(self) -> SavePolicy:
        """A fresh policy (it keeps the time of the last save: one per manager)."""
        return SavePolicy(
            every_steps=self.every_steps, every_seconds=self.every_seconds, steps=self.steps
        )

    def tier_options(self) -> dict[str, Any]:
        """The keyword arguments of PersistentTier that come from options."""
        return dict(
            keep=self.persistent_keep,
            keep_every=self.persistent_keep_every,
            every=self.persistent_every,
            grace_seconds=self.persistent_grace_seconds,
            lease_seconds=self.persistent_lease_seconds,
        )

    def check_reader(self) -> None:
        """Options that need a writer, refused with ``read_only=True``."""
        if not self.read_only:
            return
        if self.handle_sigterm:
            raise ValueError("handle_sigterm needs a writer (read_only=False)")
        if self.persistent is not None:
            raise ValueError(
                "persistent= needs a writer; to read the persistent tier, open it "
                "directly: CheckpointManager(<persistent location>, read_only=True)"
            )


# The fields of ManagerOptions taken from the keyword of the same name as given.
_PLAIN = (
    "every_steps",
    "every_seconds",
    "async_save",
    "read_only",
    "handle_sigterm",
    "clock",
    "incremental",
    "persistent",
    "persistent_keep",
    "persistent_keep_every",
    "persistent_every",
    "persistent_grace_seconds",
    "persistent_lease_seconds",
    "reuse_host_buffers",
    "format_version",
    "host_memory_budget",
    "on_event",
)
