"""Options per public entry point, counted from what ``inspect.signature`` shows.

    PYTHONPATH=CHECKOUT python tools/option_count.py

For each entry point users call: its options, the parameters ``help()`` shows beyond
the leading ones (``path``, ``tree``, ``like``, ``directory``, ``step``...). Flat
keywords accepted only for one release (the manager's ``persistent_*``, now
``persistent=Tier(...)``) are not in the signature and not counted. Reads the package
on ``PYTHONPATH``, so two checkouts give a before and after; a tool, not a test.
"""

from __future__ import annotations

import inspect

import flax_orbax_plugin as fop

ENTRY_POINTS = (
    "save",
    "save_async",
    "restore",
    "restore_params",
    "verify",
    "metadata",
    "to_safetensors",
    "from_safetensors",
    "import_orbax",
    "import_msgpack",
    "CheckpointManager",
    "CheckpointManager.save",
    "CheckpointManager.restore",
    "CheckpointCallback",
    "CheckpointCallback.on_train_start",
)
LEADING = {"self", "path", "tree", "like", "directory", "paths_or_index", "step", "items"}
LEADING |= {"source", "out", "out_dir", "path_or_tree", "state", "src", "dst", "data_iterator"}


def _target(name: str):
    owner, _, method = name.partition(".")
    value = getattr(fop, owner, None)
    return getattr(value, method, None) if method and value is not None else value


def count(name: str) -> int | None:
    target = _target(name)
    if target is None:
        return None
    params = inspect.signature(target).parameters.values()
    options = [
        p.name
        for p in params
        if p.name not in LEADING
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    return len(options)


def main() -> None:
    print("| entry point | options |")
    print("|---|---|")
    for name in ENTRY_POINTS:
        got = count(name)
        print(f"| `{name}` | {'(none)' if got is None else got} |")


if __name__ == "__main__":
    main()
