"""Hugging Face safetensors shards written as an item of a manager's step
(:class:`HFShards`). Layout and rules: ``docs/safetensors.md``.
"""

from .item import KIND, HFShards
from .key_maps import GPT2, KeyMap

__all__ = ["GPT2", "KIND", "HFShards", "KeyMap"]
