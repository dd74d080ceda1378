"""The ``flax-orbax`` command line (also ``python -m flax_orbax_plugin``)."""

from .commands import EXIT_DAMAGED, EXIT_ERROR, Progress, human_bytes, main

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "Progress", "human_bytes", "main"]
