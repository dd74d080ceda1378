"""Options of CheckpointManager and CheckpointCallback, checked when they are made.

Each option is checked by its public name and type (``keep="3"`` is a TypeError
naming ``keep``, not an error about an internal field when retention first runs).
A keyword that is not an option gets the one it most likely stands for: the names
of Orbax's ``CheckpointManagerOptions``, of ``flax.training.checkpoints`` and of
earlier versions of this library, then close spellings. :class:`ManagerOptions` is
the manager's options checked once, as one frozen record.

Pure functions; called on the constructing thread.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._core import save as _save
from .._format import layout as _layout
from .._storage.location import Location
from .checkpointables import Checkpointable, PytreeCheckpointable
from .policy import SavePolicy
from .retention import RetentionPolicy

__all__ = [
    "ManagerOptions",
    "check_item_name",
    "check_unknown",
    "keyword_names",
    "positive_int",
    "positive_number",
    "flag",
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: Any, *, none_ok: bool = True) -> None:
    """``value`` is None (if allowed) or an int >= 1; TypeError / ValueError naming it."""
    if value is None and none_ok:
        return
    if not _is_int(value):
        raise TypeError(
            f"{name} must be a positive int{' or None' if none_ok else ''}, found "
            f"{type(value).__name__} {value!r}"
        )
    if value < 1:
        raise ValueError(f"{name} must be a positive int, found {value!r}")


def positive_number(name: str, value: Any, *, none_ok: bool = True) -> None:
    """``value`` is None (if allowed) or a finite int/float > 0."""
    if value is None and none_ok:
        return
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(
            f"{name} must be a number of seconds > 0, found {type(value).__name__} {value!r}"
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, found {value!r}")


def flag(name: str, value: Any) -> None:
    """``value`` is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, found {type(value).__name__} {value!r}")


def steps_list(name: str, value: Any) -> list[int] | None:
    """``value`` (None or an iterable of ints, not a str, not one int) as a list."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an iterable of int steps, found {value!r}")
    value = list(value)
    for s in value:
        if not _is_int(s) and not (hasattr(s, "__index__") and not isinstance(s, bool)):
            raise TypeError(f"{name} must hold int steps, found {type(s).__name__} {s!r}")
    return [int(s) for s in value]


def check_manager(options: Mapping[str, Any]) -> None:
    """The CheckpointManager options (by their public names) that have a fixed type."""
    for name in ("keep", "keep_every", "keep_best", "every_steps"):
        positive_int(name, options[name])
    for name in ("persistent_keep", "persistent_keep_every"):
        positive_int(name, options[name])
    positive_int("persistent_every", options["persistent_every"], none_ok=False)
    if options["persistent"] is None and options["persistent_every"] != 1:
        raise ValueError(
            f"persistent_every={options['persistent_every']!r} needs persistent= (the "
            "persistent tier it thins out); without one every step stays local"
        )
    positive_number("every_seconds", options["every_seconds"])
    positive_number("persistent_lease_seconds", options["persistent_lease_seconds"], none_ok=False)
    grace = options["persistent_grace_seconds"]
    if not isinstance(grace, int | float) or isinstance(grace, bool) or not grace >= 0:
        raise TypeError(f"persistent_grace_seconds must be a number >= 0, found {grace!r}")
    for name in ("async_save", "read_only", "handle_sigterm", "incremental", "reuse_host_buffers"):
        flag(name, options[name])
    if options["format_version"] not in (1, 2) or isinstance(options["format_version"], bool):
        raise ValueError(f"format_version: expected 1 or 2, found {options['format_version']!r}")
    _save.check_host_memory_budget(options["host_memory_budget"])
    metric = options["best_metric"]
    if metric is not None and not isinstance(metric, str):
        raise TypeError(f"best_metric must be a key of the extras (a str), found {metric!r}")


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
            raise ValueError(f"compression[{name!r}]: item {name!r} has its own checkpointable")
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

    @classmethod
    def build(cls, directory: Any, options: Mapping[str, Any]) -> ManagerOptions:
        """Checks ``options`` (every keyword option, by its public name) and
        ``directory``; raises TypeError / ValueError naming the option."""
        check_manager(options)
        steps = steps_list("steps", options["steps"])
        location = Location.from_path(directory)
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
)
