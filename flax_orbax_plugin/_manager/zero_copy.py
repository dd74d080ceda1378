"""Zero-copy saves: a training step that never donates what a save still holds. The
training thread calls the wrapped step and ``save``, which then tells the step what it
holds (``ZeroCopyStep.saved``).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._manager.zero_copy``.
"""

from __future__ import annotations

import collections
import inspect
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._core import host_snapshot as _host_snapshot
from .._errors import CheckpointError, OptionError, OptionTypeError


def _argnums(value: int | Sequence[int], name: str, fn: Callable) -> tuple[int, ...]:
    """``value`` as a sorted tuple of distinct non-negative ints, positions ``fn`` takes,
    else OptionTypeError (a bool too) or OptionError (a negative or missing position)."""
    found = f"found {value!r:.60} ({type(value).__name__})"
    items = (value,) if isinstance(value, int) or hasattr(type(value), "__index__") else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence | set | frozenset):
        raise OptionTypeError(f"wrap_step: {name} must be an int or ints, {found}")
    try:
        if any(isinstance(v, bool) or type(v).__name__ == "bool_" for v in items):
            raise TypeError  # True is not a position
        out = tuple(sorted({operator.index(v) for v in items}))
    except TypeError:
        raise OptionTypeError(f"wrap_step: {name} must be an int or ints, {found}") from None
    if any(v < 0 for v in out):
        raise OptionError(f"wrap_step: {name} must be non-negative positions, found {value!r}")
    params = _parameters(fn)
    if params is None or not out or any(p.kind == p.VAR_POSITIONAL for p in params):
        return out  # no signature to read, or *args: the call says
    count = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    if max(out) >= count:
        raise OptionError(
            f"wrap_step: {name}={out} names argument {max(out)}, but "
            f"{getattr(fn, '__name__', fn)!r} takes {count} positional argument(s)"
        )
    return out


def _argnames(value: str | Sequence[str], fn: Callable) -> tuple[str, ...]:
    """``static_argnames`` as a tuple of distinct names ``fn`` takes by keyword, else
    OptionTypeError (not strs) or OptionError (a name its signature lacks)."""
    name = "static_argnames"
    found = f"found {value!r:.60} ({type(value).__name__})"
    items = (value,) if isinstance(value, str) else value
    if (
        isinstance(items, bytes)
        or not isinstance(items, Sequence | set | frozenset)
        or any(not isinstance(v, str) for v in items)
    ):
        raise OptionTypeError(f"wrap_step: {name} must be a str or strs, {found}")
    names = tuple(dict.fromkeys(items))
    params = _parameters(fn)
    if params is None or any(p.kind == p.VAR_KEYWORD for p in params):
        return names
    known = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise OptionError(
            f"wrap_step: {name} names {unknown[0]!r}, which "
            f"{getattr(fn, '__name__', fn)!r} does not take by keyword (its keyword "
            f"parameters: {sorted(known) or 'none'})"
        )
    return names


def _parameters(fn: Callable) -> list[inspect.Parameter] | None:
    """``fn``'s parameters, or None where it has no signature to read (a builtin)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _on_cpu(x: Any) -> bool:
    return isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.sharding.device_set)


def _pointers(x: jax.Array) -> list[int]:
    """The addresses of this process's buffers of ``x`` (one per addressable shard)."""
    return [shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards]


def _signature(x: Any) -> tuple:
    return (tuple(x.shape), str(x.dtype), x.sharding)


class ZeroCopyStep:
    """A training step that writes into a spare after each save (module docstring).

    Call it as the step itself: ``state, metrics = step(state, batch)``. Read-only
    counters: :attr:`spare_calls` (calls after a save that wrote into a spare) and
    :attr:`fresh_calls` (calls after a save with no spare: fresh memory)."""

    def __init__(
        self,
        fn: Callable,
        *,
        donate_argnums: int | Sequence[int] = 0,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
    ):
        if not callable(fn):
            raise TypeError(f"wrap_step: expected the training step function, found {fn!r}")
        self._fn = fn
        self._donate = _argnums(donate_argnums, "donate_argnums", fn)
        if not self._donate:
            raise OptionError("wrap_step: donate_argnums must name the state argument(s)")
        self._static = _argnums(static_argnums, "static_argnums", fn)
        if set(self._static) & set(self._donate):
            raise OptionError(
                f"wrap_step: an argument cannot be both static and donated "
                f"(static_argnums={self._static}, donate_argnums={self._donate})"
            )
        self._names = _argnames(static_argnames, fn)
        params = _parameters(fn) or []
        donated = {p.name for i, p in enumerate(params) if i in self._donate}
        if donated & set(self._names):
            raise OptionError(
                f"wrap_step: an argument cannot be both static and donated "
                f"(static_argnames={self._names}, donate_argnums={self._donate} names "
                f"{sorted(donated & set(self._names))})"
            )
        self._compiled: dict[str, Callable] = {}
        self._held: dict[int, jax.Array] = {}  # id -> array: what the last save holds
        self._held_save: Any = None  # that save's handle (done(): its writes are done)
        self._spare: tuple[Any, list, Any] | None = None  # (treedef, leaves, handle)
        self._checked = False  # the first call's arguments were checked
        self._calls = 0  # plain calls, counted up to 2 (the first spare is made then)
        self.spare_calls = 0
        self.fresh_calls = 0

    def saved(self, items: dict[str, Any], handle: Any) -> None:
        """A save of ``items`` (``handle``) returned: its CPU arrays are held as views."""
        if not _host_snapshot.cpu_views_are_snapshots():
            return  # the save copied what it writes: donating the state is safe
        leaves = jax.tree_util.tree_leaves(items)
        self._held = {id(x): x for x in leaves if _on_cpu(x)}
        self._held_save = handle

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._checked:  # the first call: what the state arguments are
            self._check_arguments(args)
        if not self._held:
            if self._calls < 2:  # the second call's state has the step's own shardings
                self._calls += 1
                if self._calls == 2 and self._spare is None:
                    self._spare = _first_spare(tuple(args[i] for i in self._donate))
                    if self._spare is not None:  # compiled now, not in the step after a save
                        self._variant("spare").lower(self._spare[1], *args, **kwargs).compile()
            return self._variant("plain")(*args, **kwargs)
        held, handle = self._held, self._held_save
        self._held, self._held_save = {}, None
        self._check_arguments(args)
        state = tuple(args[i] for i in self._donate)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        if not any(id(x) in held for x in leaves):  # the save held other arrays
            return self._variant("plain")(*args, **kwargs)
        inputs = {p for x in leaves if isinstance(x, jax.Array) for p in _pointers(x)}
        spare = self._take_spare(treedef, leaves, inputs)
        if spare is None:
            self.fresh_calls += 1
            out = self._variant("fresh")(*args, **kwargs)
        else:
            wanted = {p for x in spare for p in _pointers(x)}
            keys = [_key(x) for x in spare]
            out = self._variant("spare")(spare, *args, **kwargs)
            _check_aliased(wanted, keys, inputs, out)
            self.spare_calls += 1
        self._spare = (treedef, leaves, handle)  # donated once that save is written
        return out

    def _take_spare(self, treedef: Any, leaves: list, inputs: set[int]) -> list | None:
        """The previous save's arrays as a spare for this state (buffers at ``inputs``), or None."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        old_def, old, handle = spare
        if handle is not None and not handle.done():
            return None
        if old_def != treedef or len(old) != len(leaves):
            return None
        for a, b in zip(old, leaves, strict=True):
            if not (_on_cpu(a) and _on_cpu(b)) or a.is_deleted() or _signature(a) != _signature(b):
                return None
        if any(p in inputs for x in old for p in _pointers(x)):
            return None
        return old

    def _variant(self, kind: str) -> Callable:
        """The compiled step of ``kind`` (``plain``, ``spare``, ``fresh``), made once."""
        if kind not in self._compiled:
            statics = {"static_argnums": self._static, "static_argnames": self._names}
            if kind == "plain":
                made = jax.jit(self._fn, donate_argnums=self._donate, **statics)
            elif kind == "fresh":
                made = jax.jit(self._fn, **statics)
            else:
                fn = self._fn

                def into_spare(spare, *args, **kwargs):
                    del spare  # only its buffers are wanted: the outputs land there
                    return fn(*args, **kwargs)

                shifted = tuple(i + 1 for i in self._static)
                made = jax.jit(
                    into_spare,
                    donate_argnums=0,
                    keep_unused=True,  # else the unused spare is dropped, and no alias
                    static_argnums=shifted,
                    static_argnames=self._names,
                )
            self._compiled[kind] = made
        return self._compiled[kind]

    def _check_arguments(self, args: tuple) -> None:
        """Refuses a call whose state arguments are missing or NNX objects."""
        if len(args) <= self._donate[-1]:
            raise TypeError(
                f"wrap_step: the step was called with {len(args)} positional arguments; "
                f"donate_argnums={self._donate} names the state, passed positionally"
            )
        self._checked = True
        nnx = sys.modules.get("flax.nnx")  # only loaded once the user has NNX objects
        if nnx is None:
            return
        base = getattr(nnx, "Pytree", None) or nnx.Object
        for value in (args[i] for i in self._donate):
            if isinstance(value, base):
                raise TypeError(
                    f"wrap_step: the state argument is an NNX {type(value).__name__}, which "
                    f"nnx.jit updates in place; wrap_step takes functional steps over pytrees "
                    f"(a Linen TrainState, tuples or dicts of arrays): save NNX state as usual"
                )


def _first_spare(state: tuple) -> tuple[Any, list, None] | None:
    """A spare for the step after the first save, made at the second call (that step
    then costs what a steady one does); None unless all CPU arrays held as snapshots."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    if not leaves or not all(_on_cpu(x) for x in leaves):
        return None
    if not _host_snapshot.cpu_views_are_snapshots():
        return None
    groups: dict[frozenset, list[int]] = collections.defaultdict(list)
    for i, x in enumerate(leaves):  # one computation per set of devices
        groups[frozenset(x.sharding.device_set)].append(i)
    spare: list = [None] * len(leaves)
    for members in groups.values():
        shardings = [leaves[i].sharding for i in members]
        zeros = jax.jit(lambda xs: [jnp.zeros_like(x) for x in xs], out_shardings=shardings)
        for i, made in zip(members, zeros([leaves[i] for i in members]), strict=True):
            spare[i] = made
    return treedef, spare, None


def _check_aliased(wanted: set[int], keys: list[tuple], inputs: set[int], out: Any) -> None:
    """Raises when an output is in fresh memory (not the spare's buffers ``wanted``, nor
    an input) while a spare buffer of its (shape, dtype) went unused: an alias jax missed."""
    unused = collections.Counter(keys)
    fresh: list[tuple[str, jax.Array]] = []
    for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(x, jax.Array):
            continue
        ptrs = _pointers(x)
        if any(p in wanted for p in ptrs):
            unused[_key(x)] -= 1
        elif not any(p in inputs for p in ptrs):
            fresh.append((jax.tree_util.keystr(path), x))
    missed = [(path, x) for path, x in fresh if unused[_key(x)] > 0]
    if not missed:
        return
    what = ", ".join(f"{path} {tuple(x.shape)} {x.dtype}" for path, x in missed[:5])
    raise CheckpointError(
        f"wrap_step: the step after a save did not write into the spare buffers: "
        f"{len(missed)} outputs in fresh memory ({what}). jax must donate here, the outputs "
        "keep the state's shardings, and one thread calls the saves and the wrapped step"
    )


def _key(x: jax.Array) -> tuple:
    return (tuple(x.shape), str(x.dtype))
