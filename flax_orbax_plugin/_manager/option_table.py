"""The options of CheckpointManager, CheckpointCallback and the persistent tier, each
declared once (``_base.option_spec``), and the options that do nothing in a mode.

:func:`check_manager` and :func:`check_callback` check every keyword option by its
public name, where it enters (the constructor), before anything is made: a value of
the wrong type, out of range, NaN, infinite, empty or unknown is an
:class:`~flax_orbax_plugin.OptionError` (``OptionTypeError`` for a wrong type) naming
the option, what it takes and what was found. An option given in a mode where it does
nothing (``persistent_keep=`` without ``persistent=``, ``keep_every=`` when nothing is
deleted, any writer's option with ``read_only=True``...) is refused with a message
naming both. The callback checks its ``manager_options`` here too (not when the
manager is first made).

Pure functions; called on the constructing thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from .._base.option_spec import Option, check, found, refuse_without
from .._core import save_options as _save_options
from .._errors import OptionError
from .._format import layout as _layout
from .._storage.kvstore import spec_from_path
from .._storage.location import Location

__all__ = [
    "CALLBACK",
    "IMPORT",
    "MANAGER",
    "SAVE_CALL",
    "check_callback",
    "check_import",
    "check_manager",
    "check_save_call",
]

LEASE_MAX_SECONDS = 366 * 86400.0  # a lease renewed every third of it; a year at most


def _steps(value: Any) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TypeError(f"expected an iterable of int steps, found {found(value)}")
    out = []
    for s in value:
        if isinstance(s, bool) or not hasattr(s, "__index__"):
            raise TypeError(f"expected int steps, found {found(s)}")
        if int(s) < 0:
            raise ValueError(f"expected steps >= 0, found {s!r}")
        out.append(int(s))
    return out


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
        if not (callable(getattr(item, "save", None)) and callable(getattr(item, "restore", None))):
            raise TypeError(
                f"checkpointables[{name!r}]: expected a Checkpointable (save and restore "
                f"methods), found {found(item)}"
            )
    return value


def _place(name: str, value: Any) -> Any:
    """A path option: its type here; what it names is the one path checker's
    (``kvstore.spec_from_path``: an UnsupportedLocationError naming ``name``)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"expected a path or URL, found {found(value)}")
    if not isinstance(value, str | Location | dict) and not hasattr(value, "__fspath__"):
        raise TypeError(
            f"expected a path, an s3:// / gs:// URL or a kvstore dict, found {found(value)}"
        )
    if not isinstance(value, Location):
        spec_from_path(value, what=name)
    return value


DIRECTORY = Option("directory", "custom", convert=functools.partial(_place, "directory"))
"""The manager's ``directory`` (positional), checked as ``persistent`` is."""


def _writer(value: Any) -> Any:
    if not callable(getattr(value, "write_scalars", None)):
        raise TypeError(
            f"expected an object with write_scalars(step, scalars), found {found(value)}"
        )
    return value


def _int(name: str, **kw: Any) -> Option:
    return Option(name, "int", low=1, expected="a positive int" + (" or None" if kw else ""), **kw)


def _seconds(name: str, *, high: float, none_ok: bool = False) -> Option:
    words = f"a number of seconds > 0 and <= {high:g}" + (" or None" if none_ok else "")
    return Option(name, "number", low=0, low_open=True, high=high, none_ok=none_ok, expected=words)


_SHARED = (
    _int("keep", none_ok=True),
    _int("every_steps", none_ok=True),
    _seconds("every_seconds", none_ok=True, high=threading.TIMEOUT_MAX),
    Option("async_save", "flag"),
    Option("on_event", "callable", none_ok=True),
)

MANAGER: tuple[Option, ...] = (
    *_SHARED,
    _int("keep_every", none_ok=True),
    _int("keep_best", none_ok=True),
    Option("best_metric", "str", none_ok=True, expected="a key of the extras (a str) or None"),
    Option("best_mode", "choice", choices=("min", "max")),
    Option("steps", "custom", none_ok=True, convert=_steps),
    *(Option(n, "flag") for n in ("read_only", "handle_sigterm", "incremental")),
    Option("reuse_host_buffers", "flag"),
    Option("checkpointables", "custom", none_ok=True, convert=_checkpointables),
    Option("clock", "callable"),
    Option("compression", "custom", none_ok=True, convert=_compression),
    Option("format_version", "choice", choices=(1, 2)),
    Option("host_memory_budget", "int", none_ok=True, low=1, expected="a positive int or None"),
    Option("persistent", "custom", none_ok=True, convert=functools.partial(_place, "persistent")),
    _int("persistent_keep", none_ok=True),
    _int("persistent_keep_every", none_ok=True),
    _int("persistent_every"),
    Option(
        "persistent_grace_seconds",
        "number",
        low=0,
        high=threading.TIMEOUT_MAX,
        expected=f"a number of seconds >= 0 and <= {threading.TIMEOUT_MAX:g}",
    ),
    _seconds("persistent_lease_seconds", high=LEASE_MAX_SECONDS),
)
"""Every keyword option of CheckpointManager (``steps`` comes back as a list)."""

CALLBACK: tuple[Option, ...] = (
    *_SHARED,
    Option("resume", "choice", choices=(False, True, "required")),
    Option("overwrite", "flag"),
    Option("state_fn", "callable", none_ok=True),
    Option("extras_fn", "callable", none_ok=True),
    Option("writer", "custom", none_ok=True, convert=_writer),
)

_TIER = (
    "persistent_keep",
    "persistent_keep_every",
    "persistent_every",
    "persistent_grace_seconds",
    "persistent_lease_seconds",
)
# What a reader never uses: a save's options, retention's.
_WRITER = (
    "keep",
    "keep_every",
    "keep_best",
    "best_metric",
    "best_mode",
    "every_steps",
    "every_seconds",
    "steps",
    "async_save",
    "incremental",
    "compression",
    "reuse_host_buffers",
    "format_version",
    "host_memory_budget",
)


def check_manager(options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The manager options ``options`` (public names; those missing take their
    ``defaults``, the constructor's) checked, then the options that do nothing in the
    chosen mode refused (an option counts as given when it differs from its default);
    returns ``{name: checked value}`` for every option."""
    out = check(MANAGER, {**defaults, **options})
    idle = _Idle(out, defaults)
    if out["persistent"] is None:
        for name in _TIER:
            idle.refuse(name, "persistent= (the tier it configures)")
    elif Location.from_path(out["persistent"]).is_local:
        idle.refuse(
            "persistent_lease_seconds",
            "a persistent tier on an object store (a filesystem path is held by a lock)",
        )
    if out["persistent_keep"] is None:
        idle.refuse(
            "persistent_keep_every", "persistent_keep= (the tier keeps every step without it)"
        )
    if out["keep"] is None and out["keep_best"] is None:
        idle.refuse("keep_every", "keep= or keep_best= (without them no step is deleted)")
    if out["keep_best"] is None:
        idle.refuse("best_mode", "keep_best= and best_metric=")
    if out["every_seconds"] is None:
        idle.refuse("clock", "every_seconds= (the time it measures)")
    if out["format_version"] == 2:
        idle.refuse("host_memory_budget", _save_options.BUDGET_NEEDS_V1)
    if out["incremental"]:
        idle.refuse(
            "host_memory_budget",
            "incremental=False (an incremental step copies every region to host first)",
        )
    if out["read_only"]:
        for name in _WRITER:
            idle.refuse(name, "a writer (read_only=False)")
    return out


class _Idle:
    """Refuses an option given (not its default) in a mode where it does nothing."""

    def __init__(self, values: Mapping[str, Any], defaults: Mapping[str, Any]):
        self._values, self._defaults = values, defaults

    def refuse(self, name: str, needs: str) -> None:
        refuse_without(name, self._values[name], needs, default=self._defaults[name])


SAVE_CALL: tuple[Option, ...] = (
    Option("step", "int", low=0),
    Option("force", "flag"),
    Option("overwrite", "flag"),
    Option("t", "number", none_ok=True, expected="a time in seconds (a finite number) or None"),
)
"""The keyword options of ``CheckpointManager.save`` (and its step)."""


def check_save_call(**options: Any) -> int:
    """``CheckpointManager.save``'s step and options checked; returns the step."""
    return check(SAVE_CALL, options)["step"]


IMPORT: tuple[Option, ...] = (
    Option("step", "int", none_ok=True, low=0, expected="an int step >= 0 or None"),
    Option("force", "flag"),
    Option("format_version", "choice", choices=(1, 2)),
)
"""The keyword options of ``fop.import_orbax`` / ``fop.import_msgpack``."""


def check_import(**options: Any) -> dict[str, Any]:
    """An importer's options checked (before its source is read)."""
    return check(IMPORT, options)


SHARED_WITH_MANAGER = ("keep", "every_steps", "every_seconds", "async_save", "on_event")
"""The callback's options that it hands to its manager."""


def check_callback(
    options: Mapping[str, Any], manager_options: Any, manager_defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The callback's own options and its ``manager_options`` (a dict of manager
    options: checked now with the callback's, not when the manager is first made)."""
    out = check(CALLBACK, options)
    if out["resume"] is not False:
        refuse_without("overwrite", out["overwrite"], "resume=False", default=False)
    manager_options = dict(manager_options or {})  # a Mapping (options.check_callback)
    for name in SHARED_WITH_MANAGER:
        if name in manager_options:
            raise OptionError(
                f"manager_options[{name!r}]: {name} is an option of CheckpointCallback "
                f"itself (it would override it there); give {name}= to the callback"
            )
    given = {name: out[name] for name in SHARED_WITH_MANAGER}
    check_manager({**given, **manager_options}, manager_defaults)
    return out
