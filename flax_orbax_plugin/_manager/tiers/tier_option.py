"""Tier: the persistent tier a CheckpointManager replicates to (a public option object).

Each field is declared once (:data:`FIELDS`; the deprecated flat ``persistent_<field>=``
keywords are the same declarations: ``options.DEPRECATED``). Pure values, any thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, replace
from typing import Any

from ..._base.env import Option, check, found
from ..._base.keywords import refuse_without
from ..._storage import lease as _lease
from ..._storage.location import Location, spec_from_path
from ..events import Events
from ..retention import KEEP, KEEP_EVERY
from .tier import PersistentTier

__all__ = ["FIELDS", "Tier", "check_place", "refuse_idle"]


def check_place(name: str, value: Any) -> Any:
    """A path option ``name`` checked: its type here, what it names by ``spec_from_path``."""
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"expected a path or URL, found {found(value)}")
    if not isinstance(value, str | Location | dict) and not hasattr(value, "__fspath__"):
        raise TypeError(
            f"expected a path, an s3:// / gs:// URL or a kvstore dict, found {found(value)}"
        )
    if not isinstance(value, Location):
        spec_from_path(value, what=name)
    return value


PATH = Option("persistent", "custom", convert=functools.partial(check_place, "persistent"))
"""A tier's path, checked as the manager's ``persistent=`` (the name its errors give)."""

FIELDS: tuple[Option, ...] = (
    # the manager's own retention fields, without their aliases, documented for the tier
    replace(
        KEEP,
        aliases=(),
        doc="the tier's own retention: its last N steps (None: every replicated step)",
    ),
    replace(KEEP_EVERY, aliases=(), doc="also keep every step divisible by it there, forever"),
    Option(
        "every",
        "int",
        low=1,
        default=1,
        expected="a positive int",
        doc="replicate only the committed steps divisible by it (and the SIGTERM step)",
    ),
    Option(
        "grace_seconds",
        "number",
        low=0,
        high=threading.TIMEOUT_MAX,
        default=30.0,
        expected=f"a number of seconds >= 0 and <= {threading.TIMEOUT_MAX:g}",
        doc="after SIGTERM, how long the exit waits for its step to be replicated",
    ),
    Option(
        "lease_seconds",
        "number",
        low=_lease.MIN_LEASE_SECONDS,
        high=_lease.MAX_LEASE_SECONDS,
        default=_lease.LEASE_SECONDS,
        expected=(
            f"a number of seconds >= {_lease.MIN_LEASE_SECONDS:g} and <= "
            f"{_lease.MAX_LEASE_SECONDS:g}"
        ),
        doc="on an object store, the lease that makes one live run own the path",
    ),
)
"""The keyword fields of :class:`Tier` (its path is positional)."""


def refuse_idle(values: dict[str, Any], local: bool, name: Callable[[str], str] = str) -> None:
    """Refuses a tier's field that does nothing (``name(field)``: as it was given)."""
    if values["keep"] is None:
        refuse_without(
            name("keep_every"),
            values["keep_every"],
            f"{name('keep')}= (the tier keeps every step without it)",
        )
    if local:
        default = _lease.LEASE_SECONDS
        needs = "a persistent tier on an object store (a filesystem path is held by a lock)"
        refuse_without(name("lease_seconds"), values["lease_seconds"], needs, default=default)


@dataclass(frozen=True)
class Tier:
    """A persistent tier: ``path`` (``s3://``, ``gs://``, a shared filesystem path or a
    kvstore spec) and its keyword fields (``FIELDS``; see docs/tiers.md).

    Checked when made: OptionError naming the field, an UnsupportedLocationError for
    the path. Frozen; any thread.
    """

    path: Any
    _: KW_ONLY
    keep: int | None = None
    keep_every: int | None = None
    every: int = 1
    grace_seconds: float = 30.0
    lease_seconds: float = _lease.LEASE_SECONDS

    def __post_init__(self) -> None:
        PATH.check(self.path)
        values = check(FIELDS, {o.name: getattr(self, o.name) for o in FIELDS})
        for field_name, value in values.items():
            object.__setattr__(self, field_name, value)
        refuse_idle(values, Location.from_path(self.path).is_local)

    def open(
        self,
        local: Location,
        *,
        remove_step: Callable[[Location, int], None],
        busy: Callable[[], bool],
        per_host: bool,
        host_memory: int | str | None = None,
        events: Events | None = None,
    ) -> PersistentTier:
        """The ``PersistentTier`` this option describes, replicating ``local`` (the
        manager's writer open calls it; the other arguments: see PersistentTier)."""
        return PersistentTier(
            local,
            self,
            remove_step=remove_step,
            busy=busy,
            per_host=per_host,
            host_memory=host_memory,
            events=events,
        )
