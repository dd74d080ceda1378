"""The package's version, from the installed distribution's metadata (stdlib only, so
``flax-orbax --version`` imports nothing heavy). Read on first use (:func:`version`):
``importlib.metadata`` takes a few hundredths of a second to import, which the CLI
must not spend before it takes Ctrl-C (``cli.main``)."""

from __future__ import annotations

import functools

DISTRIBUTION = "flax_orbax_plugin"


@functools.cache
def version() -> str:
    from importlib import metadata  # on first use: see the module docstring

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
