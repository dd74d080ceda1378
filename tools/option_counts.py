"""The keyword options of each public entry point, counted from its signature.

    python tools/option_counts.py

Prints, per entry point, the options its signature shows (``inspect.signature``: the
constructors' signatures are made from the option declarations) and, for the
manager, how many of them are shorthands of an option object and how many older
keywords are still taken with a DeprecationWarning. Run it on two commits to compare.
"""

from __future__ import annotations

import inspect

import flax_orbax_plugin as fop

ENTRY_POINTS = {
    "CheckpointManager": fop.CheckpointManager,
    "CheckpointManager.save": fop.CheckpointManager.save,
    "CheckpointCallback": fop.CheckpointCallback,
    "fop.save": fop.save,
    "fop.save_async": fop.save_async,
    "fop.restore": fop.restore,
    "restore_params": fop.restore_params,
}


def options(function) -> list[str]:
    """Every parameter a caller may name, but the leading positional ones that carry
    the data (``self``, a path, the tree, the step, the state)."""
    params = inspect.signature(function).parameters.values()
    data = {"self", "directory", "path", "tree", "step", "state", "like"}
    return [p.name for p in params if p.name not in data and p.kind is not p.VAR_KEYWORD]


def main() -> None:
    for name, function in ENTRY_POINTS.items():
        names = options(function)
        print(f"{name}: {len(names)} ({', '.join(names)})")
    try:
        from flax_orbax_plugin._manager import options as option_table
    except ImportError:
        return
    deprecated = getattr(option_table, "DEPRECATED", ())
    shorthands = [
        *getattr(option_table, "RETENTION_SHORTHANDS", ()),
        *getattr(option_table, "POLICY_SHORTHANDS", ()),
    ]
    print(
        f"CheckpointManager: {len(shorthands)} of its options are shorthands of an option "
        f"object; {len(deprecated)} older keywords still taken with a DeprecationWarning"
    )


if __name__ == "__main__":
    main()
