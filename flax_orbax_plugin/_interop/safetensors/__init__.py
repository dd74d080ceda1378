"""Hugging Face safetensors, both ways: sharded export and sharded, resharding import.

:mod:`.headers` is the file layout (the dtype table, names, headers and the index,
checked when read); :mod:`.plan` turns leaves into tensors and shards; :mod:`.outputs`
owns what an export writes and replaces; :mod:`.export` is :func:`to_safetensors`;
:mod:`.reader` is :func:`from_safetensors`. The layout, the trust rules and who calls
what: ``docs/safetensors.md``.
"""

from .export import (
    ExportResult,
    export_checkpoint,
    key_map_from_file,
    to_safetensors,
)
from .headers import DTYPE_NAMES, read_safetensors_index
from .plan import parse_size
from .reader import from_safetensors

__all__ = [
    "DTYPE_NAMES",
    "ExportResult",
    "export_checkpoint",
    "from_safetensors",
    "key_map_from_file",
    "parse_size",
    "read_safetensors_index",
    "to_safetensors",
]
