"""The ``flax-orbax`` command line (also ``python -m flax_orbax_plugin``).

    flax-orbax list DIR [--json]             steps, sizes, times, metrics
    flax-orbax inspect PATH [--json] [--plot F]   leaves: shapes, dtypes, shardings, bytes
    flax-orbax verify PATH [--json]          every checksum; exit 1 naming what is damaged
    flax-orbax export PATH OUT --format safetensors [--dtype bfloat16]
    flax-orbax gc DIR [--keep N] [--dry-run] [--json]   retention; remove unfinished steps

Modules: ``main`` (parser, entry point: the standard library only, so ``--help`` and
``--version`` are instant), ``dispatch`` (after parsing: path checks, then the command;
it imports JAX and tensorstore), ``commands`` (one function per command), ``paths``
(what a PATH names), ``output`` (exit codes, sizes, times), ``display`` (rich: bars and
tables), ``json_output`` (the ``--json`` documents and their schemas), ``plot``
(``inspect --plot``, matplotlib), ``store_errors`` (object-store failures as one line).
"""

from .main import main
from .output import EXIT_DAMAGED, EXIT_ERROR, human_bytes

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "human_bytes", "main"]
