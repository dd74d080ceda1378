"""``fop.HFShards``: a Hugging Face safetensors set written as an item of a step.

Threading: ``save`` on the training thread (the blocking phase), ``Pending.wait`` on the
manager's background thread, ``restore`` on the caller's.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._interop.hf_shards.item``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ..._base import distributed as _distributed
from ..._base import tree as _tree
from ..._base.env import Option, found
from ..._core.formats import SaveRequest
from ..._core.reads import ReadRequest
from ..._errors import OptionError, OptionTypeError, StructureError, UnsupportedLocationError
from ..._format import layout as _layout
from ..._manager.checkpointables import COPY_KINDS, encode_json
from ..._storage.location import Location
from ..safetensors.plan import checked_cast, parse_size
from ..safetensors.reader import from_safetensors
from . import writing as _writing
from .key_maps import KeyMap, check_transposes, key_map_of, transpose_patterns
from .layout import plan

__all__ = ["HFShards"]

_SAVE, _READ = SaveRequest(), ReadRequest()  # frozen: what a call without one does
KIND = COPY_KINDS[0]  # the kind the step manifest records: read only when named
_EVERY_STEPS = Option("HFShards(every_steps=)", "int", low=1)


@dataclasses.dataclass(frozen=True)
class HFShards:
    """Hugging Face shards of item ``item`` as item ``name`` of every saved step that is
    a multiple of ``every_steps`` (see the module docstring).

    The options are keyword-only, checked here.

    Args:
      every_steps: a positive int; steps ``0, K, 2K ...`` (among those saved) get them.
      item: the item written (default ``"params"``).
      name: the item's name in the step (default ``"hf"``: ``<step>/hf/``).
      key_map: ``"gpt2"`` (a GPT-2-shaped Flax model: ``key_maps.GPT2``), a dict or
        pairs ``{regex over the leaf path: tensor name (re's \\1) or None}`` (first
        full match wins; a leaf no rule matches is an error), a KeyMap, or None
        (names as ``fop.to_safetensors`` gives them: the path with '/' replaced by
        '.', or every full path when two leaves would get one name that way).
      transposes: regexes of the leaves written as ``(out, in, ...)`` from
        ``(..., in, out)`` (added to the built-in map's own).
      max_shard_bytes: bytes or a size (``"5GB"``, ``"2GiB"``) per file.
      dtype: cast floating leaves (e.g. ``"bfloat16"``): an explicit, lossy opt-in.
      config: a JSON dict written as ``config.json`` (``from_pretrained`` reads it).
    """

    every_steps: int
    item: str = "params"
    name: str = "hf"
    key_map: Any = None
    transposes: Any = None
    max_shard_bytes: int | str = "5GB"
    dtype: Any = None
    config: Mapping[str, Any] | None = None
    kind: str = dataclasses.field(default=KIND, init=False)
    _map: KeyMap | None = dataclasses.field(default=None, init=False, repr=False)
    _limit: int = dataclasses.field(default=0, init=False, repr=False)
    _cast: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        put = functools.partial(object.__setattr__, self)
        put("every_steps", _EVERY_STEPS.check(self.every_steps))  # numpy's ints are ints
        for field in ("item", "name"):
            value = getattr(self, field)
            if not _layout.is_safe_name(value):
                cls = OptionError if isinstance(value, str) else OptionTypeError
                raise cls(
                    f"HFShards({field}=): expected an item name (letters, digits, '_', '-', "
                    f"'.'; not starting with '_' or '.'), found {found(value)}"
                )
        if self.item == self.name:
            raise OptionError(f"HFShards: item= and name= are both {self.item!r}")
        put("_cast", checked_cast(self.dtype, "HFShards(dtype=)", byte_sized=True))
        if self.config is not None:
            if not isinstance(self.config, Mapping):
                raise OptionTypeError(
                    f"HFShards(config=): expected a dict, found {found(self.config)}"
                )
            try:  # the save's own rule, now rather than at the first save
                encode_json(dict(self.config), "HFShards(config=)")
            except StructureError as e:
                raise OptionError(str(e)) from None
        put("_map", key_map_of(self.key_map, self.transposes))
        put("_limit", parse_size(self.max_shard_bytes, "HFShards(max_shard_bytes=)"))

    def due(self, step: int) -> bool:
        """Whether a saved ``step`` gets the shards."""
        return step % self.every_steps == 0

    # -- the Checkpointable protocol

    def save(self, directory: Location, value: Any, request: SaveRequest = _SAVE):
        """Blocking phase: the layout, then this process's regions copied to host."""
        count = _distributed.process_count()
        if count > 1 and (request.own_copy or not directory.is_local):
            where = "each host's own directory" if request.own_copy else str(directory)
            raise UnsupportedLocationError(
                f"hf_shards: {count} processes would each write their own byte ranges into "
                f"the shard files, which {where} cannot take; save the shards to a "
                f"directory every host shares, or from a single process"
            )
        flat, _ = _tree.flatten(value)
        leaves, values = [], {}
        for path, _, leaf in flat:
            if leaf is None:
                continue
            dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
            if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
                raise StructureError(
                    f"leaf {path!r}: a PRNG key array has no safetensors equivalent; keep "
                    f"keys out of item {self.item!r} or leave it out (key_map: None)"
                )
            leaves.append((path, np.dtype(dtype), tuple(np.shape(leaf))))
            values[path] = leaf
        paths = [path for path, _, _ in leaves]
        check_transposes(transpose_patterns(self.transposes), paths, self.item)
        layout = plan(leaves, self._map, self._limit, self._cast, {"item": self.item})
        regions = _writing.snapshot(layout, values)
        return _writing.Pending(directory, layout, regions, self.config, request.cancelled)

    def restore(self, directory: Location, like: Any, request: ReadRequest = _READ):
        """``{tensor name: numpy array}`` of the set (local disk). The values of item
        ``item`` come back from that item; ``like`` here must be None."""
        if like is not None:
            raise ValueError(
                f"item {self.name!r} (Hugging Face shards) restores as {{tensor name: array}} "
                f"only (like=None); restore item {self.item!r} for a tree of the model"
            )
        if not directory.is_local:
            raise UnsupportedLocationError(
                f"{directory}: item {self.name!r} (Hugging Face shards) is read back from "
                f"local disk only; copy the step's {self.name}/ directory down"
            )
        return from_safetensors(directory.path)
