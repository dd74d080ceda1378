"""Hugging Face safetensors, both ways: :func:`to_safetensors` (sharded export) and
:func:`from_safetensors` (resharding read). Layout and rules: ``docs/safetensors.md``.
"""

from .export import export_checkpoint, key_map_from_file, to_safetensors
from .headers import read_safetensors_index
from .plan import parse_size
from .reader import from_safetensors

__all__ = [
    "export_checkpoint",
    "from_safetensors",
    "key_map_from_file",
    "parse_size",
    "read_safetensors_index",
    "to_safetensors",
]
