"""The ``flax-orbax`` command line (also ``python -m flax_orbax_plugin``): ``list``,
``inspect``, ``verify``, ``export``, ``import``, ``gc`` (``flax-orbax COMMAND --help``).

Modules: ``main`` (parser, entry point: the standard library only, so ``--help`` and
``--version`` are instant; ``usage``: errors the arguments alone show), ``dispatch``
(after parsing: path checks, then the command; it imports JAX and tensorstore),
``commands``, ``list_command``, ``verify_command`` (the commands; ``gc_plan``: what
``gc --dry-run`` would remove), ``paths`` (what a PATH names), ``output`` (exit codes,
sizes, times), ``display`` (rich: bars and tables), ``json_output`` (the ``--json``
documents and their schemas), ``plot`` (``--plot``, matplotlib), ``shell`` (signals
and streams of a shell's command), ``native_logs`` (AWS log lines kept off stderr).
"""

from .main import main
from .output import EXIT_DAMAGED, EXIT_ERROR, human_bytes

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "human_bytes", "main"]
