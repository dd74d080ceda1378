"""What a failed import or export created, and so may remove again: the directories
that creating its output made, and the files it wrote into the deepest of them.
(Re-exported by ``_core.ownership``, the one owner of removal.)

Threading: stateless; any function may be called from any thread.
"""

from __future__ import annotations

import os


def missing_directories(path: str) -> list[str]:
    """The directories that creating local ``path`` (``os.makedirs``) would create, the
    deepest first: what a failed import or export created, and so may remove."""
    missing, path = [], os.path.abspath(path)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_created(directories: list[str], files: tuple[str, ...] = ()) -> None:
    """After a failed import or export: removes ``files`` (names inside the deepest of
    ``directories`` that this call created: regular files, never through a link), then
    each of ``directories`` that is empty, deepest first (``rmdir``: a directory that
    holds anything else, someone else's included, stays)."""
    for name in files if directories else ():
        path = os.path.join(directories[0], name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
    for path in directories:
        try:
            os.rmdir(path)
        except OSError:
            return  # not empty (or gone): it and its parents stay
