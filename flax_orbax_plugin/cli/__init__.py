"""The ``flax-orbax`` command line (also ``python -m flax_orbax_plugin``).

    flax-orbax list DIR                      steps, sizes, times, metrics
    flax-orbax inspect PATH                  leaves: shapes, dtypes, shardings, bytes
    flax-orbax verify PATH                   every checksum; exit 1 naming what is damaged
    flax-orbax export PATH OUT --format safetensors [--dtype bfloat16]
    flax-orbax gc DIR [--keep N]             retention; remove unfinished steps

Modules: ``main`` (parser, entry point: the standard library only, so ``--help`` and
``--version`` are instant), ``dispatch`` (after parsing: path checks, then the command;
it imports JAX and tensorstore), ``commands`` (one function per command),
``paths`` (what a PATH names), ``output`` (exit codes, tables, progress).
"""

from .main import main
from .output import EXIT_DAMAGED, EXIT_ERROR, Progress, human_bytes

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "Progress", "human_bytes", "main"]
