"""Hugging Face safetensors shards written as an item of a manager's step.

:mod:`.key_maps` names the tensors (the built-in GPT-2 map, regex maps, transposes);
:mod:`.layout` computes the files, headers and offsets from the global shapes alone;
:mod:`.writing` writes one process's regions at their offsets; :mod:`.item` is
:class:`HFShards`, the option and checkpointable. Layout and rules:
``docs/safetensors.md`` ("Shards written while training").
"""

from .item import KIND, HFShards
from .key_maps import GPT2, KeyMap

__all__ = ["GPT2", "KIND", "HFShards", "KeyMap"]
