"""The ``flax-orbax`` command line (also ``python -m flax_orbax_plugin``): ``list``,
``inspect``, ``verify``, ``export``, ``import``, ``gc``.

``main`` parses (the standard library only: ``--help`` is instant), ``dispatch`` runs a
command after its paths are checked; one module per concern beside them.
"""

from .main import main
from .output import EXIT_DAMAGED, EXIT_ERROR, human_bytes

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "human_bytes", "main"]
