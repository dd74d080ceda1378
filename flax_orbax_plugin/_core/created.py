"""What a failed import or export created, and so may remove again (re-exported by
``_core.ownership``).

Threading: stateless; any function may be called from any thread.
"""

from __future__ import annotations

import os


def missing_directories(path: str) -> list[str]:
    """The directories ``os.makedirs(path)`` would create, the deepest first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_created(directories: list[str], files: tuple[str, ...] = ()) -> None:
    """Removes ``files`` (regular files in the deepest of ``directories``, never through a
    link), then each of ``directories`` that is empty, deepest first."""
    for name in files if directories else ():
        path = os.path.join(directories[0], name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
    for path in directories:
        try:
            os.rmdir(path)
        except OSError:
            return  # not empty (or gone): it and its parents stay
