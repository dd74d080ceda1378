"""The stores a CheckpointManager's call may reach (for ``store_errors.refusals``).

Pure function of a call's bound arguments; any thread.
"""

from __future__ import annotations

from typing import Any

__all__ = ["manager_places"]


def manager_places(bound: dict[str, Any]) -> list[Any]:
    """The stores a manager's call may reach: its directory and its persistent tier."""
    options = bound.get("options") or {}
    tier = options.get("persistent")
    # ``directory`` (the property) once __init__ has set it; the argument before
    own = getattr(bound["self"], "directory", None)
    return [bound.get("directory"), getattr(tier, "path", tier), own]
