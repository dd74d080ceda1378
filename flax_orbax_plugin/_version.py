"""The package's version: the one place it is written.

``setup.cfg`` reads it (``version = attr: flax_orbax_plugin._version.__version__``,
parsed without importing the package), so the installed distribution's metadata,
``flax_orbax_plugin.__version__`` and ``flax-orbax --version`` all say the same. A plain
string: ``flax-orbax --version`` imports this module and nothing heavy. Changes between
versions, and what to write instead of what changed: CHANGELOG.md."""

from __future__ import annotations

__version__ = "0.6.0"
