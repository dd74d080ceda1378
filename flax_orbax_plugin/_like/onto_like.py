"""Casting a saved leaf (checked), retargeting a template, placing foreign data onto ``like``.

The cast policy is an argument of every check. An importer calls ``plan`` once per leaf
(it raises before anything is read), then ``materialize``. No state; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.onto_like``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._base.env import flag
from .._base.shown import outside_stacklevel
from .._base.tree import encode_key, path_string
from .._errors import OptionError, OptionTypeError, StructureError
from .surgery import check_surgery
from .transform_rules import compile_transform
from .transform_rules import describe as describe_transform

CAST_POLICIES = ("safe", "unsafe")


def _category(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "bool"
    if dtype.kind == "c":
        return "complex"
    if dtype.kind == "f" or _is_ml_float(dtype):
        return "float"
    if dtype.kind in "iu" or _is_ml_int(dtype):
        return "int"
    return "other"


def _is_ml_float(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.finfo(dtype)
    except (ValueError, TypeError):
        return False
    return dtype.kind == "V"


def _is_ml_int(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.iinfo(dtype)
    except (ValueError, TypeError):
        return False
    return True


def _first(values: np.ndarray, bad: np.ndarray | None = None) -> Any:
    flat = values.reshape(-1)
    if bad is not None:
        index = int(np.argmax(bad.reshape(-1)))
        return flat[index].item() if flat.dtype.kind in "biufc" else float(flat[index])
    if flat.size == 0:
        return None
    return flat[0].item() if flat.dtype.kind in "biufc" else float(flat[0])


def _changed(values: np.ndarray, changed: np.ndarray) -> Any:
    """The first value marked ``changed``, or None when none is."""
    return _first(values, changed) if changed.any() else None


ADVICE = "pass cast='unsafe' to cast anyway"  # the end of each refusal (readers' own: onto_like)


def with_advice(error: StructureError, advice: str) -> str:
    """A refusal of :func:`check` with another way out at its end than ``cast='unsafe'``
    (a caller whose option has another name: a reader's, ``HFShards``, the CLI's flag)."""
    return str(error).replace(ADVICE, advice)


def _fail(path: str, src: np.dtype, dst: np.dtype, why: str, example: Any) -> StructureError:
    shown = "" if example is None else f" (e.g. {example!r})"
    return StructureError(f"leaf {path!r}: saved as {src}, requested {dst}: {why}{shown}; {ADVICE}")


def _float_changes(x: np.ndarray, dst: np.dtype) -> np.ndarray | None:
    """Mask of float values that a cast to ``dst`` turns into something other than a
    rounding (finite to inf/NaN, inf to NaN or finite, NaN to a number, a finite value
    past ``dst``'s range: a dtype without inf (float4, float6) saturates it to its
    largest value); None if none."""
    orig = x if x.dtype.kind == "f" else x.astype(np.float32)  # ml_dtypes floats
    back = x.astype(dst).astype(orig.dtype)
    finite = np.isfinite(orig)
    bad = finite & ~np.isfinite(back)
    bad |= finite & (np.abs(orig.astype(np.float64)) >= _overflow_at(dst))
    if not finite.all():  # inf must stay the same inf, NaN stay NaN
        nan = np.isnan(orig)
        bad |= (nan & ~np.isnan(back)) | (~finite & ~nan & (back != orig))
    return bad if bad.any() else None


@functools.lru_cache(maxsize=64)
def _holds_bools(dst: np.dtype) -> bool:
    """Whether 0 and 1 are values of ``dst`` (float8_e8m0fnu, powers of two only, has
    no 0)."""
    with np.errstate(all="ignore"):
        back = np.array([0, 1], np.uint8).astype(dst).astype(np.float64)
    return back.tolist() == [0.0, 1.0]


def _overflow_at(dst: np.dtype) -> float:
    """The magnitude from which a value rounds past ``dst``'s largest finite value (its
    largest plus half a step there, where round-to-nearest-even leaves the range)."""
    info = ml_dtypes.finfo(dst)
    largest = float(info.max)
    return largest + 2.0 ** (np.floor(np.log2(largest)) - int(info.nmant)) / 2


def check_tree(host: Any, target: Any, *, cast: str) -> None:
    """:func:`check` for every leaf of ``host`` (numpy values) against the dtype of the
    matching leaf of ``target`` (arrays or ShapeDtypeStructs of the same structure)."""

    def one(keypath, x, t):
        # str, bytes and None leaves pass through (no dtype to cast to or from)
        if x is not None and not isinstance(x, str | bytes) and hasattr(t, "dtype"):
            path = path_string([encode_key(k) for k in keypath])
            check(path, np.asarray(x), t.dtype, cast=cast)

    jax.tree_util.tree_map_with_path(one, host, target, is_leaf=lambda x: x is None)


def check_policy(cast: Any) -> str:
    """``cast=`` where it enters (restore, restore_params, the exporter, a request):
    one of :data:`CAST_POLICIES`, else an OptionError naming it."""
    if cast not in CAST_POLICIES:
        raise OptionError(f"cast must be one of {CAST_POLICIES}, found {cast!r:.60}")
    return cast


def legacy_cast(cast: Any, allow_cast: Any, *, where: str) -> str:
    """``cast=`` of an entry point that took ``allow_cast=`` in earlier releases
    (``from_safetensors``, ``restore_orbax``): the policy, checked; ``allow_cast=``
    given (True or False) still works this release, with a DeprecationWarning naming
    ``cast=``; both given is an OptionError."""
    check_policy(cast)
    if allow_cast is None:
        return cast
    allow_cast = flag("allow_cast", allow_cast)  # True or False (numpy's too), else said
    if cast != "safe":
        raise OptionError(f"{where}: cast= and allow_cast= given together; cast= alone")
    new = "unsafe" if allow_cast else "safe"
    warnings.warn(
        f"{where}(allow_cast={allow_cast}) is deprecated: write cast={new!r}, as restore "
        f"and restore_params take it",
        DeprecationWarning,
        stacklevel=outside_stacklevel(),
    )
    return new


def check(path: str, host: np.ndarray, out_dtype: Any, *, cast: str = "safe") -> None:
    """Raises StructureError if casting ``host`` (a leaf's saved data) to ``out_dtype``
    would change a value beyond float rounding; a no-op under ``cast="unsafe"``."""
    src, dst = np.dtype(host.dtype), np.dtype(out_dtype)
    check_policy(cast)
    if src == dst or cast == "unsafe":
        return
    a, b = _category(src), _category(dst)
    if a == "bool":
        if b == "other":
            raise _fail(path, src, dst, "no cast from bool to this dtype", _first(host))
        if _holds_bools(dst):
            return  # False/True are 0/1
        bad = ~host.astype(np.bool_) if host.size else None
        if bad is not None and bad.any():  # float8_e8m0fnu has no 0: False would be NaN
            raise _fail(path, src, dst, "this dtype has no 0 (False)", _first(host, bad))
        return
    # Refused by dtype, whatever the values; the example shown is a value the cast would
    # change (none when every value would survive it: the rule is still the dtype's).
    with np.errstate(all="ignore"):
        if b == "bool":
            why = "a cast to bool is refused (it turns every nonzero value into True)"
            raise _fail(path, src, dst, why, _changed(host, (host != 0) & (host != 1)))
        if a == "complex" and b != "complex":
            why = "a cast from complex to real is refused (it drops the imaginary part)"
            raise _fail(path, src, dst, why, _changed(host, np.imag(host) != 0))
        if a == "float" and b == "int":
            why = "a cast from float to integer is refused (it truncates)"
            wide = host.astype(np.float64)  # (ml_dtypes floats too)
            raise _fail(path, src, dst, why, _changed(host, ~np.isfinite(wide) | (wide % 1 != 0)))
    if "other" in (a, b):
        raise _fail(path, src, dst, "no checked cast between these dtypes", None)
    with np.errstate(all="ignore"):
        if a == "int":
            values = host.astype(np.int64) if src.kind == "V" else host  # int4/uint4
            if b == "int":
                _check_int_range(path, values, src, dst)
            else:
                _check_int_exact(path, values, src, dst, np.finfo(dst).dtype)
            return
        # float or complex to float or complex: rounding only
        parts = (np.real(host), np.imag(host)) if a == "complex" else (host,)
        target = np.finfo(dst).dtype if b == "complex" else dst
        for part in parts:
            part = np.asarray(part)
            bad = _float_changes(part, target)
            if bad is not None:
                raise _fail(
                    path, src, dst, "a value overflows or is not representable", _first(part, bad)
                )


def _iinfo(dtype: np.dtype):
    try:
        return np.iinfo(dtype)
    except ValueError:
        return ml_dtypes.iinfo(dtype)


def _check_int_range(path: str, values: np.ndarray, src: np.dtype, dst: np.dtype) -> None:
    have, want = np.iinfo(values.dtype), _iinfo(dst)
    lo, hi = max(int(want.min), int(have.min)), min(int(want.max), int(have.max))
    if lo == int(have.min) and hi == int(have.max):
        return  # every value of the saved dtype fits
    bad = (values < lo) | (values > hi)
    if bad.any():
        why = "a value does not fit and would wrap around"
        raise _fail(path, src, dst, why, _first(values, bad))


def _check_int_exact(path, values: np.ndarray, src, dst, real: np.dtype) -> None:
    back = values.astype(real).astype(np.float64)
    bad = ~np.isfinite(back)
    if values.dtype.itemsize < 8:  # float64 holds every such integer exactly
        bad |= back != values.astype(np.float64)
    else:
        lo, hi = (0.0, 2.0**64) if values.dtype.kind == "u" else (-(2.0**63), 2.0**63)
        inside = (back >= lo) & (back < hi)
        bad |= ~inside
        bad |= np.where(inside, back, 0).astype(values.dtype) != values
    if bad.any():
        raise _fail(path, src, dst, "an integer is not exactly representable", _first(values, bad))


def checked_dtype(dtype: Any) -> Any:
    """``dtype=`` (cast the floating leaves to it): None or a floating dtype, else an
    OptionError naming it (a cast of floats to integers truncates every value)."""
    if dtype is None:
        return None
    try:
        found = jnp.dtype(dtype)
    except TypeError:
        raise OptionTypeError(
            f"dtype: expected a floating dtype (e.g. jnp.bfloat16 or 'bfloat16'), found "
            f"{dtype!r:.60}"
        ) from None
    if not jnp.issubdtype(found, jnp.floating):
        raise OptionError(
            f"dtype: expected a floating dtype to cast the floating leaves to, found {found}"
        )
    return found


def retarget(tree: Any, dtype: Any, sharding: Any) -> Any:
    """ShapeDtypeStructs for ``tree`` with floating leaves cast to ``dtype`` and new shardings
    (one Sharding for every leaf, or a pytree of them); leaves without a shape pass, and
    a numpy leaf no sharding is given for stays a numpy template (read to the host)."""
    dtype = checked_dtype(dtype)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [leaf for _, leaf in with_paths]
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        shardings = [sharding] * len(leaves)
    else:
        try:
            shardings = treedef.flatten_up_to(sharding)
        except (TypeError, ValueError) as e:
            raise OptionTypeError(
                f"sharding: expected one jax Sharding, or a pytree of them of the params' "
                f"structure, found {type(sharding).__name__} {sharding!r:.60} ({e})"
            ) from None
        bad = [s for s in shardings if s is not None and not isinstance(s, jax.sharding.Sharding)]
        if bad:
            raise OptionTypeError(
                f"sharding: expected jax Shardings in the pytree, found {bad[0]!r:.60}"
            )
    out = []
    for (keypath, leaf), sh in zip(with_paths, shardings, strict=True):
        if not hasattr(leaf, "shape"):
            out.append(leaf)
            continue
        dt = leaf.dtype
        if dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(dtype)
        if sh is None and isinstance(leaf, np.ndarray | np.generic):
            out.append(_on_host(leaf, dt))  # asked for on the host: stays numpy, its dtype
            continue
        if sh is None:
            sh = getattr(leaf, "sharding", None)
            if sh is not None and not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
                sh = None
        try:
            if isinstance(sh, jax.sharding.Sharding):
                sh.shard_shape(tuple(leaf.shape))  # one that cannot hold it: named here
            out.append(jax.ShapeDtypeStruct(leaf.shape, _on_device(dt), sharding=sh))
        except ValueError as e:  # jax's IndivisibleError: named here, with the leaf's shape
            path = path_string([encode_key(k) for k in keypath])
            raise StructureError(
                f"leaf {path!r}: sharding {sh} cannot hold its shape {tuple(leaf.shape)}: {e}"
            ) from None
    return jax.tree_util.tree_unflatten(treedef, out)


def _on_device(dtype: Any) -> Any:
    """The dtype a device array of ``dtype`` holds: int64 / float64 are int32 / float32
    unless jax_enable_x64 is on. Asked for as such, so the checked cast refuses a value
    the narrower dtype cannot hold (placing the wide data wrapped it silently)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype  # a PRNG key's dtype: its own
    return jax.dtypes.canonicalize_dtype(dtype)


def _on_host(leaf: np.ndarray | np.generic, dtype: Any) -> np.ndarray | np.generic:
    """A numpy leaf of a like with no sharding asked for it, as a numpy template of
    ``dtype``: the restore gives numpy of exactly that dtype (a ShapeDtypeStruct would
    give a device array, its int64 made int32 without jax_enable_x64). Allocates
    nothing: a broadcast of one value."""
    if leaf.dtype == dtype:
        return leaf
    if isinstance(leaf, np.generic):
        return np.zeros((), dtype)[()]
    return np.broadcast_to(np.zeros((), dtype), leaf.shape)


def concrete(tree: Any, *, option: str | None = None) -> Any:
    """``tree`` (a like, or a pytree of shardings) with every sharding on an
    ``AbstractMesh`` (``nnx.eval_shape`` under ``jax.set_mesh`` gives these) put on the
    concrete mesh of the ``jax.set_mesh`` around the call; a StructureError naming the
    leaf where there is none of that shape (an abstract mesh names no devices to read
    onto; ``option``: the option ``tree`` is, named instead). ``tree`` itself when it
    holds no abstract sharding (the common case)."""
    if not any(_abstract_mesh(leaf) for leaf in jax.tree_util.tree_leaves(tree)):
        return tree  # every restore asks: no key paths built for the common case
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for keypath, leaf in with_paths:
        if _abstract_mesh(leaf):
            path = path_string([encode_key(k) for k in keypath])
            where = f"leaf {path!r}" if option is None else f"{option} ({path})"
            leaf = _on_concrete(leaf, where.replace(" (<root>)", ""))
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def _sharding_of(leaf: Any) -> Any:
    return leaf if isinstance(leaf, jax.sharding.Sharding) else getattr(leaf, "sharding", None)


def _abstract_mesh(leaf: Any) -> bool:
    return isinstance(getattr(_sharding_of(leaf), "mesh", None), jax.sharding.AbstractMesh)


def _on_concrete(leaf: Any, where: str) -> Any:
    sharding = _sharding_of(leaf)
    mesh = jax.sharding.get_mesh()  # the concrete mesh of `with jax.set_mesh(...)`, if any
    if mesh.empty or mesh.shape_tuple != sharding.mesh.shape_tuple:
        raise StructureError(
            f"{where}: its sharding is on an abstract mesh {dict(sharding.mesh.shape)} "
            f"(nnx.eval_shape under jax.set_mesh gives these), which names no devices to "
            f"read onto: restore inside `with jax.set_mesh(mesh):` with that mesh, or give "
            f"NamedSharding(mesh, spec) on a concrete jax.sharding.Mesh"
        )
    placed = jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    if isinstance(leaf, jax.sharding.Sharding):
        return placed
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=placed)


Reader = Callable[[tuple[slice, ...]], np.ndarray]


def describe(x: Any) -> str:
    """A short description of a like leaf for error messages."""
    if x is None:
        return "None"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None:
        return f"{type(x).__name__}(shape={tuple(shape)}, dtype={dtype})"
    return type(x).__name__


def near_miss(path: str, stored: Collection[str]) -> str:
    """Words to add where like's leaf ``path`` is missing from a checkpoint that holds
    it one level off: below it (an NNX State's ``<path>/value``) or under a key (the
    tree saved inside a dict), or above it (saved without NNX's ``/value``); ""
    otherwise. One pass over ``stored`` (a dict or set of the saved paths)."""
    if path.endswith("/value") and path[: -len("/value")] in stored:
        return (
            f"; it holds {path[: -len('/value')]!r}: saved without NNX's '/value' "
            f"(transform={{r'$': '/value'}} maps the saved paths onto like's)"
        )
    if path + "/value" in stored:
        return (
            f"; it holds {path + '/value'!r}: an NNX State's leaves, restored into "
            f"like=nnx.state(model) (or transform={{r'/value$': ''}} on this "
            f"library's checkpoints)"
        )
    for saved in stored:
        if saved.startswith(path + "/"):
            return f"; it holds {saved!r}, below like's leaf"
        if saved.endswith("/" + path):
            under = saved[: -len(path) - 1]
            linen = (
                " (Linen's state.params is {'params': ...} itself, and a manager reads a "
                "dict like as {item: like}: pass like={'params': state.params}, or the "
                "TrainState)"
                if under == "params"
                else ""
            )
            return f"; it holds {saved!r}: like is the tree under {under!r}{linen}"
    return ""


def _is_float(dtype: np.dtype) -> bool:
    if dtype.kind in "biuc":
        return False
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


def is_lossless(src: Any, dst: Any) -> bool:
    """True when every value of ``src`` is exactly representable in ``dst``."""
    src, dst = np.dtype(src), np.dtype(dst)
    if src == dst or src == np.bool_:
        return True
    if _is_float(src) and _is_float(dst):
        s, d = ml_dtypes.finfo(src), ml_dtypes.finfo(dst)
        return d.nmant >= s.nmant and d.maxexp >= s.maxexp and d.minexp <= s.minexp
    if np.issubdtype(src, np.integer) and _is_float(dst):
        bits = src.itemsize * 8 - (1 if np.issubdtype(src, np.signedinteger) else 0)
        return ml_dtypes.finfo(dst).nmant + 1 >= bits
    if np.issubdtype(src, np.integer) and np.issubdtype(dst, np.integer):
        return bool(np.can_cast(src, dst, "safe"))
    if np.issubdtype(src, np.complexfloating) and np.issubdtype(dst, np.complexfloating):
        return bool(np.can_cast(src, dst, "safe"))
    if _is_float(src) and np.issubdtype(dst, np.complexfloating):
        return bool(np.can_cast(src, dst, "safe"))
    return False


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """What one leaf becomes: checked before any byte is read."""

    path: str
    shape: tuple[int, ...]
    stored_dtype: np.dtype
    out_dtype: np.dtype
    like: Any
    python_scalar: bool  # like None and the source stored a Python scalar
    key_impl: Any = None  # like is a PRNG key array: wrap the stored key data
    check_values: bool = False  # a narrowing cast: allowed only if no value changes
    source: str = ""
    cast_option: str = "cast='unsafe'"  # what the entry point takes to cast anyway
    rounds: bool = False  # dtype= asked for a narrower float: it may round, never overflow

    def cast(self, data: np.ndarray) -> np.ndarray:
        """``data`` in ``out_dtype``. A checked cast follows the rules every reader
        shares (``_like.casting``: float to integer never, even for whole values) and,
        stricter here, changes no value at all (a float may round where ``rounds``);
        else StructureError."""
        if data.dtype == self.out_dtype:
            return data
        if self.check_values:
            try:
                check(self.path, data, self.out_dtype, cast="safe")
            except StructureError as e:
                words = with_advice(e, f"pass {self.cast_option} to cast anyway")
                raise StructureError(f"{words} (in {self.source})") from None
        with np.errstate(all="ignore"):  # unchecked: numpy's cast, as asked
            out = data.astype(self.out_dtype)
        if self.check_values and not self.rounds:
            back = out.astype(data.dtype)
            same = back == data
            if _is_float(data.dtype) or data.dtype.kind == "c":
                same |= np.isnan(data) & np.isnan(back)
            if not same.all():
                raise StructureError(
                    f"leaf {self.path!r}: dtype mismatch: expected {self.out_dtype} "
                    f"(from like), found {data.dtype} in {self.source}, and casting changes "
                    f"values (pass {self.cast_option} to cast anyway)"
                )
        return out


@functools.lru_cache(maxsize=256)
def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a jax PRNG key dtype (asked once per dtype, not per leaf)."""
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def template_of(path: str, like: Any) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) a leaf of ``like`` asks for: an array, a ShapeDtypeStruct or a
    scalar; StructureError naming the leaf for anything else."""
    if isinstance(like, (bool, int, float, complex)):
        return (), np.asarray(like).dtype
    if isinstance(like, jax.ShapeDtypeStruct) and not _is_extended(like.dtype):
        # what jax will hold: int64 / float64 are int32 / float32 unless jax_enable_x64
        # is on (a value the narrower dtype cannot hold is refused, not truncated)
        return tuple(like.shape), jax.dtypes.canonicalize_dtype(like.dtype)
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        return tuple(like.shape), like.dtype
    raise StructureError(
        f"leaf {path!r}: expected like to hold an array, ShapeDtypeStruct, scalar or None, "
        f"found {type(like).__name__}"
    )


def _is_extended(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def plan(
    path: str,
    shape: tuple[int, ...],
    dtype: Any,
    like: Any,
    *,
    source: str,
    allow_cast: bool = False,
    python_scalar: bool = False,
    cast_option: str = "cast='unsafe'",
    rounds: bool = False,
) -> LeafPlan:
    """Checks that the stored ``shape``/``dtype`` fit ``like``; ``source`` names the file,
    ``cast_option`` what the calling entry point takes to cast anyway (its messages say).
    ``rounds``: a checked cast may round a float (``dtype=`` asked for it), as
    ``fop.restore``'s does; overflow, wrap-around and truncation are still refused.

    Raises StructureError naming the leaf, the expected and the found value.
    """
    shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
    if like is None:
        return LeafPlan(path, shape, dtype, dtype, None, python_scalar)
    like_shape, like_dtype = template_of(path, like)
    if is_key_dtype(like_dtype):
        impl = getattr(like_dtype, "_impl", None)
        key_shape = like_shape + tuple(getattr(impl, "key_shape", ()))
        if impl is None or key_shape != shape or dtype != np.uint32:
            raise StructureError(
                f"leaf {path!r}: expected key data for {describe(like)} (from like), "
                f"found {dtype}{list(shape)} in {source}"
            )
        return LeafPlan(path, shape, dtype, dtype, like, False, impl)
    if like_shape != shape:
        raise StructureError(
            f"leaf {path!r}: shape mismatch: expected {like_shape} (from like), "
            f"found {shape} in {source}"
        )
    like_dtype = np.dtype(like_dtype)
    check = not allow_cast and not is_lossless(dtype, like_dtype)
    return LeafPlan(
        path,
        shape,
        dtype,
        like_dtype,
        like,
        False,
        check_values=check,
        source=source,
        cast_option=cast_option,
        rounds=rounds,
    )


def _sharding(like: Any) -> Any:
    if isinstance(like, jax.Array):
        return like.sharding
    if isinstance(like, jax.ShapeDtypeStruct):
        return getattr(like, "sharding", None)
    return None


def materialize(leaf: LeafPlan, read: Reader) -> Any:
    """Reads the leaf through ``read(index)`` and returns it in the form of ``like``."""
    like = leaf.like
    whole = tuple(slice(0, s) for s in leaf.shape)
    if leaf.key_impl is not None:
        keys = jax.random.wrap_key_data(np.asarray(read(whole)), impl=leaf.key_impl)
        sharding = _sharding(like)
        return jax.device_put(keys, sharding) if sharding is not None else keys
    if like is None:
        data = np.asarray(read(whole))
        return data[()].item() if leaf.python_scalar else data
    if isinstance(like, (bool, int, float, complex)):
        return type(like)(leaf.cast(np.asarray(read(whole)))[()])
    if isinstance(like, np.generic):
        return leaf.cast(np.asarray(read(whole)))[()]
    if isinstance(like, np.ndarray):
        return leaf.cast(np.asarray(read(whole)))
    sharding = _sharding(like)
    if sharding is None:
        return jax.device_put(leaf.cast(np.asarray(read(whole))), jax.devices()[0])
    size = int(np.prod(leaf.shape, dtype=np.int64))
    if sharding.is_fully_replicated or size == 0:
        return jax.device_put(leaf.cast(np.asarray(read(whole))), sharding)
    by_index: dict[tuple, list] = collections.defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        index = tuple(
            slice(*s.indices(dim)[:2]) if isinstance(s, slice) else s
            for s, dim in zip(index, leaf.shape, strict=True)
        )
        by_index[tuple((s.start, s.stop) for s in index)].append((device, index))
    pieces = []
    for devices in by_index.values():
        data = leaf.cast(np.asarray(read(devices[0][1])))
        pieces.extend(jax.device_put(data, device) for device, _ in devices)
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, pieces)


# The options of a restore into a changed model (partial, missing, transform, surgery),
# checked once by every restore entry point (their words: transform_rules, surgery).
MISSING_CHOICES = ("error", "keep", "keep_all")


@dataclasses.dataclass(frozen=True)
class Changes:
    """The validated options of a restore into a changed model."""

    partial: bool = False
    missing: str = "error"
    transform: Callable[[str], str | None] | None = None
    surgery: tuple[Any, ...] = ()  # checked operations (``surgery.check_surgery``)
    # An item that mirrors params (an optimizer state): the operations apply at every
    # prefix where they match, and nowhere without a word (``surgery_mirrors``).
    surgery_mirrored: bool = False

    @property
    def keep_missing(self) -> bool:
        return self.missing in ("keep", "keep_all")

    @property
    def nothing_may_match(self) -> bool:
        """``missing="keep_all"``: a restore that matches no saved leaf only warns."""
        return self.missing == "keep_all"

    def describe(self) -> str:
        """The options as given, for messages."""
        rules = describe_transform(self.transform)
        out = f"partial={self.partial}, missing={self.missing!r}, {rules}"
        return out + (f", surgery={list(self.surgery)!r}" if self.surgery else "")

    def kwargs(self) -> dict[str, Any]:
        """The options as ``restore`` keywords (``transform`` already compiled)."""
        out = {"partial": self.partial, "missing": self.missing, "transform": self.transform}
        return out | {"surgery": self.surgery}

    def rename(self, path: str) -> str | None:
        return path if self.transform is None else self.transform(path)


def changes(
    *, partial: Any = False, missing: Any = "error", transform: Any = None, surgery: Any = None
) -> Changes:
    """Validates the options (TypeError / ValueError naming the option; TransformError
    for ``transform``, see ``transform_rules``, and ``surgery``, see ``surgery``) and
    compiles ``transform`` once. Called by every restore entry point before anything
    is read."""
    partial = flag("partial", partial)
    if missing not in MISSING_CHOICES:
        raise OptionError(f"missing must be one of {MISSING_CHOICES}, found {missing!r}")
    # A plain restore (no transform, no surgery) compiles and checks nothing more.
    compiled = None if transform is None else compile_transform(transform)
    return Changes(partial, missing, compiled, () if surgery is None else check_surgery(surgery))
