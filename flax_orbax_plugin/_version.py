"""The package's version, from the installed distribution's metadata (stdlib only, so
``flax-orbax --version`` imports nothing heavy)."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "flax_orbax_plugin"


def _installed_version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


__version__ = _installed_version()
