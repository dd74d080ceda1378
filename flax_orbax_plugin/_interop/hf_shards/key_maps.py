"""Key maps of Hugging Face shards: leaf path -> tensor name, and whether it is
transposed. Pure functions over frozen records; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._interop.hf_shards.key_maps``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..._base import shown as _shown
from ..._errors import OptionError, OptionTypeError
from ..._like.transform_rules import template_fault

__all__ = ["GPT2", "KeyMap", "check_transposes", "key_map_of", "transpose_patterns"]


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """Rules ``((pattern, replacement or None), ...)`` and ``transposes``, checked when made."""

    rules: tuple[tuple[str, str | None], ...]
    transposes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for pattern, replacement in self.rules:
            regex = _compile(pattern, "key_map")
            if replacement is not None and not isinstance(replacement, str):
                raise OptionTypeError(
                    f"key_map[{pattern!r}]: expected a tensor name (str) or None, found "
                    f"{type(replacement).__name__} {replacement!r}"
                )
            fault = None if replacement is None else template_fault(regex, replacement)
            if fault is not None:
                raise OptionError(f"key_map[{pattern!r}]: {fault}")
        for pattern in self.transposes:
            _compile(pattern, "transposes")

    def name(self, path: str) -> tuple[bool, str | None]:
        """(matched, tensor name or None) of leaf ``path``."""
        for pattern, replacement in self.rules:
            m = re.fullmatch(pattern, path)
            if m is not None:
                return True, None if replacement is None else m.expand(replacement)
        return False, None

    def transposed(self, path: str) -> bool:
        return any(re.fullmatch(p, path) for p in self.transposes)


def _compile(pattern: Any, option: str) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        cls = OptionError if isinstance(pattern, str) else OptionTypeError
        raise cls(f"{option}: expected a regular expression (str), found {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise OptionError(f"{option}: {pattern!r} is no regular expression: {e}") from None


_P = r"(?:params/)?(?:transformer/)?"  # a Flax variables dict's 'params', HF's prefix
_H = _P + r"h[_/]([0-9]+)/"  # a Linen list of blocks (h_0) or a dict of them (h/0)

GPT2 = KeyMap(
    rules=(
        (_P + r"wte/embedding", "transformer.wte.weight"),
        (_P + r"wpe/embedding", "transformer.wpe.weight"),
        (_H + r"(ln_1|ln_2)/scale", r"transformer.h.\1.\2.weight"),
        (_H + r"(ln_1|ln_2)/bias", r"transformer.h.\1.\2.bias"),
        (_H + r"(attn|mlp)/(c_attn|c_proj|c_fc)/kernel", r"transformer.h.\1.\2.\3.weight"),
        (_H + r"(attn|mlp)/(c_attn|c_proj|c_fc)/bias", r"transformer.h.\1.\2.\3.bias"),
        (_P + r"ln_f/scale", "transformer.ln_f.weight"),
        (_P + r"ln_f/bias", "transformer.ln_f.bias"),
        (r"(?:params/)?lm_head/kernel", "lm_head.weight"),
    ),
    transposes=(r"(?:params/)?lm_head/kernel",),  # a Linear: (out, in) in PyTorch
)
"""The built-in map of a GPT-2-shaped Flax model (``key_map="gpt2"``)."""

BUILT_IN = {"gpt2": GPT2}


def key_map_of(key_map: Any, transposes: Iterable[str] | None) -> KeyMap | None:
    """The :class:`KeyMap` of ``HFShards(key_map=, transposes=)``."""
    extra = transpose_patterns(transposes)
    if key_map is None:
        return KeyMap((), extra) if extra else None
    if isinstance(key_map, str):
        if key_map not in BUILT_IN:
            raise OptionError(
                f"key_map: expected one of {sorted(BUILT_IN)}, a dict {{pattern: tensor "
                f"name}} or a KeyMap, found {key_map!r}"
            )
        key_map = BUILT_IN[key_map]
    if isinstance(key_map, KeyMap):
        return dataclasses.replace(key_map, transposes=key_map.transposes + extra)
    pairs = list(key_map.items()) if isinstance(key_map, Mapping) else _pairs(key_map)
    return KeyMap(tuple(pairs), extra)


def transpose_patterns(transposes: Any) -> tuple[str, ...]:
    """``transposes=``: None, a regular expression or several; OptionTypeError else."""
    if transposes is None:
        return ()
    if isinstance(transposes, str):
        return (transposes,)
    try:
        return tuple(transposes)
    except TypeError:
        raise OptionTypeError(
            f"transposes: expected a regular expression (str) or a list of them, found "
            f"{type(transposes).__name__} {transposes!r:.60}"
        ) from None


def check_transposes(patterns: tuple[str, ...], paths: list[str], item: str) -> None:
    """OptionError for a pattern of ``transposes=`` that matches no leaf path (a typo)."""
    for pattern in patterns:
        if not any(re.fullmatch(pattern, path) for path in paths):
            raise OptionError(
                f"transposes: {pattern!r} matches no leaf path of item {item!r}; its "
                f"leaves: {_shown.listed(paths, limit=6, fmt=repr, empty='none')}"
            )


def _pairs(key_map: Any) -> list[tuple[str, str | None]]:
    try:
        pairs = [tuple(p) for p in key_map]
    except TypeError:
        pairs = None
    if pairs is None or not all(len(p) == 2 for p in pairs):
        raise OptionTypeError(
            f"key_map: expected 'gpt2', a dict {{pattern: tensor name or None}}, pairs "
            f"(pattern, name) or a KeyMap, found {type(key_map).__name__} {key_map!r}"[:300]
        )
    return pairs
