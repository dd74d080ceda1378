"""The ``flax-orbax`` command line (also ``python -m flax_orbax_plugin``): ``list``,
``inspect``, ``verify``, ``export``, ``import``, ``gc``."""

from .main import main
from .output import EXIT_DAMAGED, EXIT_ERROR, human_bytes

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "human_bytes", "main"]
