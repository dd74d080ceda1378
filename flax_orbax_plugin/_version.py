"""The package's version, the one place it is written: ``setup.cfg`` reads it without
importing the package, so the distribution, ``__version__`` and ``flax-orbax --version``
agree. Changes between versions: CHANGELOG.md."""

from __future__ import annotations

__version__ = "0.6.0"
