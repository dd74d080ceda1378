"""The options every process must open a writing manager with, compared at its open.

One collective key-value round, on the constructing thread; otherwise pure functions.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.agreement``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Mapping
from typing import Any

from .._base import distributed as _distributed
from .._errors import CoordinationError

# ManagerOptions field -> the public name a user sees in the error.
SHARED = {
    "policy": "the save policy (every_steps=, every_seconds=, policy=, ...)",
    "retention": "the retention (keep=, keep_every=, keep_best=, retention=, ...)",
    "tier": "persistent=",
    "overrides": "checkpointables= / compression=",
    "supersede": "supersede=",
    "handle_sigterm": "handle_sigterm=",
    "incremental": "incremental=",
    "format_version": "format_version=",
    "stall_timeout": "stall_timeout=",
    "hf_shards": "hf_shards=",
}


def _describe(value: Any) -> Any:
    """``value`` as JSON equal on two processes exactly when the option is (objects by
    type and public plain attributes, functions by name, a clock left out)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {  # a clock is each host's own (the primary decides a time policy)
            f.name: _describe(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.name != "clock"
        }
        return {"type": type(value).__qualname__, **fields}
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, range):  # steps=range(...): kept as a range, never listed
        return {"type": "range", "start": value.start, "stop": value.stop, "step": value.step}
    if isinstance(value, (set, frozenset)):
        return sorted((_describe(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if inspect.isroutine(value) or isinstance(value, type):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    simple = (str, int, float, bool, type(None))
    public = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("_")}
    return {
        "type": type(value).__qualname__,
        **{k: v for k, v in public.items() if isinstance(v, simple)},
    }


def shared_view(opts: Any) -> dict[str, Any]:
    """The options of ``opts`` (a ``ManagerOptions``) that every process must share."""
    return {field: _describe(getattr(opts, field)) for field in SHARED}


def check_same_options(opts: Any, region: _distributed.Region | None) -> None:
    """Collective (a writer's open, in ``region``): CoordinationError on every process
    naming each option whose :func:`shared_view` differs, and each process's value."""
    if _distributed.process_count() == 1:
        return
    views = _distributed.gather_json("manager-options", shared_view(opts), region=region)
    differ = []
    for field, label in SHARED.items():
        values = [json.dumps(v[field], sort_keys=True) for v in views]
        if len(set(values)) > 1:
            short = [v if len(v) <= 160 else v[:157] + "..." for v in values]
            each = "; ".join(f"process {p}: {v}" for p, v in enumerate(short))
            differ.append(f"{label} differs ({each})")
    if differ:
        raise CoordinationError(
            f"{opts.location}: the processes opened this manager with different options: "
            + ". ".join(differ)
            + ". Every process must pass the same (each would save, delete or write "
            "steps the others do not)"
        )
