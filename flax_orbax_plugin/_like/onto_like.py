"""Reading onto ``like``: the saved tree matched against the template, a saved leaf cast
(checked), a template retargeted, and the options of a restore into a changed model.

A reader calls :func:`changes` once (before anything is read), then
:func:`rename_records` and :func:`match`. No state; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._like.onto_like``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Collection
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._base.env import flag
from .._base.shown import outside_stacklevel
from .._base.tree import encode_key, flatten, path_string
from .._errors import NothingMatchedError, OptionError, OptionTypeError, StructureError
from .._format import layout as _layout
from .surgery import check_surgery
from .transform_rules import compile_transform, unmatched_rules
from .transform_rules import describe as describe_transform

logger = logging.getLogger("flax_orbax_plugin")

CAST_POLICIES = ("safe", "unsafe")


def _category(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "bool"
    if dtype.kind in "cfiu":
        return {"c": "complex", "f": "float", "i": "int", "u": "int"}[dtype.kind]
    for info, name in ((ml_dtypes.finfo, "float"), (ml_dtypes.iinfo, "int")):  # ml_dtypes'
        try:
            info(dtype)
        except (ValueError, TypeError):
            continue
        return name
    return "other"


def _first(values: np.ndarray, bad: np.ndarray | None = None) -> Any:
    """The first value of ``values`` (where ``bad``, if given) as a Python number; None
    where there is none."""
    flat = values.reshape(-1)
    if flat.size == 0 or (bad is not None and not bad.any()):
        return None
    x = flat[0 if bad is None else int(np.argmax(bad.reshape(-1)))]
    return x.item() if flat.dtype.kind in "biufc" else float(x)


ADVICE = "pass cast='unsafe' to cast anyway"  # the end of each refusal (readers' own: onto_like)


def with_advice(error: StructureError, advice: str) -> str:
    """A refusal of :func:`check` ending in ``advice`` (an option of another name)."""
    return str(error).replace(ADVICE, advice)


def _fail(path: str, src: np.dtype, dst: np.dtype, why: str, example: Any) -> StructureError:
    shown = "" if example is None else f" (e.g. {example!r})"
    return StructureError(f"leaf {path!r}: saved as {src}, requested {dst}: {why}{shown}; {ADVICE}")


def _float_changes(x: np.ndarray, dst: np.dtype) -> np.ndarray | None:
    """Mask of float values a cast to ``dst`` changes beyond rounding (to or from inf/NaN,
    past ``dst``'s range: float4/float6 saturate); None if none."""
    orig = x if x.dtype.kind == "f" else x.astype(np.float32)  # ml_dtypes floats
    back = x.astype(dst).astype(orig.dtype)
    finite = np.isfinite(orig)
    bad = finite & ~np.isfinite(back)
    info = ml_dtypes.finfo(dst)  # half a step past dst's largest, a value rounds past it
    largest = float(info.max)
    overflow = largest + 2.0 ** (np.floor(np.log2(largest)) - int(info.nmant)) / 2
    bad |= finite & (np.abs(orig.astype(np.float64)) >= overflow)
    if not finite.all():  # inf must stay the same inf, NaN stay NaN
        nan = np.isnan(orig)
        bad |= (nan & ~np.isnan(back)) | (~finite & ~nan & (back != orig))
    return bad if bad.any() else None


@functools.lru_cache(maxsize=64)
def _holds_bools(dst: np.dtype) -> bool:
    """Whether 0 and 1 are values of ``dst`` (float8_e8m0fnu has no 0)."""
    with np.errstate(all="ignore"):
        back = np.array([0, 1], np.uint8).astype(dst).astype(np.float64)
    return back.tolist() == [0.0, 1.0]


def check_tree(host: Any, target: Any, *, cast: str) -> None:
    """:func:`check` for every leaf of ``host`` against ``target``'s leaf's dtype."""

    def one(keypath, x, t):
        # str, bytes and None leaves pass through (no dtype to cast to or from)
        if x is not None and not isinstance(x, str | bytes) and hasattr(t, "dtype"):
            path = path_string([encode_key(k) for k in keypath])
            check(path, np.asarray(x), t.dtype, cast=cast)

    jax.tree_util.tree_map_with_path(one, host, target, is_leaf=lambda x: x is None)


def check_policy(cast: Any) -> str:
    """``cast=``: one of :data:`CAST_POLICIES`, else an OptionError naming it."""
    if cast not in CAST_POLICIES:
        raise OptionError(f"cast must be one of {CAST_POLICIES}, found {cast!r:.60}")
    return cast


def legacy_cast(cast: Any, allow_cast: Any, *, where: str) -> str:
    """``cast=`` of an entry point that took ``allow_cast=`` before: that still works, with
    a DeprecationWarning; both given is an OptionError."""
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
            raise _fail(path, src, dst, why, _first(host, (host != 0) & (host != 1)))
        if a == "complex" and b != "complex":
            why = "a cast from complex to real is refused (it drops the imaginary part)"
            raise _fail(path, src, dst, why, _first(host, np.imag(host) != 0))
        if a == "float" and b == "int":
            why = "a cast from float to integer is refused (it truncates)"
            wide = host.astype(np.float64)  # (ml_dtypes floats too)
            raise _fail(path, src, dst, why, _first(host, ~np.isfinite(wide) | (wide % 1 != 0)))
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
                why = "a value overflows or is not representable"
                raise _fail(path, src, dst, why, _first(part, bad))


def _check_int_range(path: str, values: np.ndarray, src: np.dtype, dst: np.dtype) -> None:
    have, want = np.iinfo(values.dtype), ml_dtypes.iinfo(dst)
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
    """``dtype=``: None or a floating dtype, else an OptionError naming it."""
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
    """ShapeDtypeStructs for ``tree``, floating leaves cast to ``dtype``, with ``sharding``
    (one, or a pytree); a numpy leaf with no sharding stays a numpy template."""
    dtype = checked_dtype(dtype)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        shardings = [sharding] * len(with_paths)
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
        if sh is None and isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            sh = leaf.sharding
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
    """The dtype a device array of ``dtype`` holds (int64 is int32 without x64; a PRNG
    key's, its own), so the checked cast refuses a value the narrower dtype cannot hold."""
    extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    return dtype if extended else jax.dtypes.canonicalize_dtype(dtype)


def _on_host(leaf: np.ndarray | np.generic, dtype: Any) -> np.ndarray | np.generic:
    """A numpy leaf with no sharding, as a numpy template of ``dtype`` (read to the host
    as exactly that dtype); a broadcast of one value, allocating nothing."""
    if leaf.dtype == dtype:
        return leaf
    if isinstance(leaf, np.generic):
        return np.zeros((), dtype)[()]
    return np.broadcast_to(np.zeros((), dtype), leaf.shape)


def concrete(tree: Any, *, option: str | None = None) -> Any:
    """``tree`` (a like, or shardings) with every sharding on an ``AbstractMesh`` put on the
    mesh of the ``jax.set_mesh`` around the call; a StructureError naming the leaf (or
    ``option``) where there is none of that shape."""
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


def describe(x: Any) -> str:
    """A short description of a like leaf for error messages."""
    if x is None:
        return "None"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None:
        return f"{type(x).__name__}(shape={tuple(shape)}, dtype={dtype})"
    return type(x).__name__


_LINEN = (
    " (Linen's state.params is {'params': ...} itself, and a manager reads a dict like as "
    "{item: like}: pass like={'params': state.params}, or the TrainState)"
)


def near_miss(path: str, stored: Collection[str]) -> str:
    """Words to add where like's leaf ``path`` is missing from ``stored`` (the saved
    paths) that hold it one level off (NNX's ``/value``, under a key); else ""."""
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
            linen = _LINEN if under == "params" else ""
            return f"; it holds {saved!r}: like is the tree under {under!r}{linen}"
    return ""


def _is_float(dtype: np.dtype) -> bool:
    return _category(dtype) == "float"


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


@functools.lru_cache(maxsize=256)
def is_key_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a jax PRNG key dtype."""
    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def template_of(path: str, like: Any) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) a leaf of ``like`` asks for; StructureError for a non-array."""
    if isinstance(like, (bool, int, float, complex)):
        return (), np.asarray(like).dtype
    if isinstance(like, jax.ShapeDtypeStruct):  # what jax will hold
        return tuple(like.shape), _on_device(like.dtype)
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        return tuple(like.shape), like.dtype
    raise StructureError(
        f"leaf {path!r}: expected like to hold an array, ShapeDtypeStruct, scalar or None, "
        f"found {type(like).__name__}"
    )


MISSING_CHOICES = ("error", "keep", "keep_all")


@dataclasses.dataclass(frozen=True)
class Changes:
    """The validated options of a restore into a changed model."""

    partial: bool = False
    missing: str = "error"
    transform: Callable[[str], str | None] | None = None
    surgery: tuple[Any, ...] = ()  # checked operations (``surgery.check_surgery``)
    surgery_mirrored: bool = False

    @property
    def keep_missing(self) -> bool:
        return self.missing in ("keep", "keep_all")

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
    """The options checked (an error naming the option), ``transform`` compiled once;
    every restore entry point calls it before anything is read."""
    partial = flag("partial", partial)
    if missing not in MISSING_CHOICES:
        raise OptionError(f"missing must be one of {MISSING_CHOICES}, found {missing!r}")
    compiled = None if transform is None else compile_transform(transform)
    return Changes(partial, missing, compiled, () if surgery is None else check_surgery(surgery))


MAX_LISTED = 40  # differences shown in one message; the rest are counted
PATHS_SHOWN = 4  # paths of each side named when nothing matched
NO_DATA = ("none", *_layout.EMPTY_KINDS)  # records that match without holding a value

KEEP = object()  # a leaf of like restored as like's own value

HINT = (
    "If the model changed on purpose: partial=True leaves out saved leaves the model no "
    "longer has, missing='keep' keeps like's own value for leaves the checkpoint lacks, "
    "transform={regex: replacement} (or a callable path -> path or None) maps saved "
    "paths onto like's"
)


def rename_records(records: dict[str, Any], opts: Changes, where: str) -> dict[str, Any]:
    """``records`` keyed by the paths ``opts.transform`` maps them to (None: left out);
    two saved leaves onto one path raise."""
    if opts.transform is None:
        return records
    for pattern in unmatched_rules(opts.transform, records):  # a typo, most likely
        warnings.warn(
            f"transform rule {pattern!r} matched no saved leaf path of {where} (they look "
            f"like {next(iter(records), '(none)')!r}): it changed nothing",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for path, value in records.items():
        new = opts.rename(path)
        if new is None:
            continue
        if new in out:
            raise StructureError(
                f"transform maps the saved leaves {origin[new]!r} and {path!r} of {where} "
                f"both to {new!r}"
            )
        out[new], origin[new] = value, path
    return out


def check_keepable(path: str, leaf: Any) -> None:
    """Raises when ``leaf`` (missing from the checkpoint) has no value to keep."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise StructureError(
            f"leaf {path!r}: not in the checkpoint, and missing='keep' has no value to keep: "
            f"like holds a ShapeDtypeStruct{tuple(leaf.shape)} there; pass a concrete value "
            f"(an initialised model) for that leaf"
        )


def check_item_keepable(name: str, value: Any) -> None:
    """:func:`check_keepable` for every leaf of an item of like the step lacks."""
    flat, _ = flatten(value)
    for path, _, leaf in flat:
        check_keepable(f"{name}/{path}" if path != "<root>" else name, leaf)


def _cast_problem(path: str, record: Any, like: Any, cast: str) -> str | None:
    """Why no checked cast takes the saved dtype to like's whatever the values (float to
    int, complex to real); None when one may."""
    if record.dtype is None or record.kind == "prng_key" or like is None:
        return None
    try:
        _, want = template_of(path, like)
        if is_key_dtype(want):
            return None
        saved = _layout.dtype_from_name(record.dtype, path=path)
        if saved == want:  # the usual case: nothing to cast
            return None
        check(path, np.empty((0,), saved), np.dtype(want), cast=cast)
    except StructureError as e:
        return str(e)
    return None


def match(
    flat: list[tuple[str, Any, Any]],
    records: dict[str, tuple[int, Any]],
    opts: Changes,
    *,
    where: str,
    make: Callable[[int, Any, Any], Any],
    empty_kinds: tuple[str, ...] = (),
    saved: list[str],
    cast: str,
    problems: list[str] | None = None,
) -> list[Any]:
    """One entry per leaf of ``flat`` (like's ``(path, keys, leaf)``): ``make(index,
    record, leaf)`` for a leaf the checkpoint holds, :data:`KEEP` for one kept from like.

    ``records``: ``{like path: (index, record)}``; ``saved``: the checkpoint's paths
    holding a value. Every difference (after ``problems``) goes into one StructureError;
    a plan reading none of ``saved`` raises NothingMatchedError (:func:`check_matched`)."""
    problems = list(problems or ())
    _refuse_one_leaf(flat, records, where)
    casts: list[str] = []  # dtypes no checked cast reaches
    out: list[Any] = []
    for path, _, leaf in flat:
        found = records.get(path)
        if found is None:
            out.append(_missing(path, leaf, records, opts, problems))
            continue
        index, record = found
        try:
            out.append(make(index, record, leaf))
        except StructureError as e:
            problems.append(_renamed(str(e), record.path, path))
            out.append(None)
            continue
        why = _cast_problem(record.path, record, leaf, cast)
        if why is not None:
            casts.append(_renamed(why, record.path, path))
    if not opts.partial:
        wanted = {path for path, _, _ in flat}
        problems += [
            f"leaf {path!r}: unexpected key: found in the checkpoint but not in like "
            f"(partial=True leaves it out)"
            for path, (_, record) in records.items()
            if path not in wanted and record.kind not in empty_kinds
        ]
    if problems:  # casts alone are refused by the read itself, naming a value
        raise mismatch(problems + casts, where)
    found = [records.get(path) for path, _, _ in flat]
    if not any(f is not None and f[0] >= 0 and f[1].kind not in NO_DATA for f in found):
        like_paths = [
            p for p, _, _ in flat if p not in records or records[p][1].kind not in NO_DATA
        ]
        check_matched(saved, like_paths, sorted(records), opts, where)
    return out


def _refuse_one_leaf(flat: list, records: dict[str, Any], where: str) -> None:
    """like=object(), like=5: no tree at all, while the checkpoint is one."""
    if [p for p, _, _ in flat] == ["<root>"] and "<root>" not in records and records:
        leaf = flat[0][2]
        raise mismatch(
            [
                f"like is one leaf ({type(leaf).__name__} {leaf!r:.60}), not a tree: the "
                f"checkpoint holds {len(records)} leaf(s) ({sorted(records)[:3]}); "
                f"give like the saved structure (fop.metadata(path) lists it), or like=None"
            ],
            where,
        )


def _missing(path: str, leaf: Any, records: dict, opts: Changes, problems: list[str]) -> Any:
    """The entry of like's leaf ``path`` the checkpoint lacks: KEEP, or None and a problem."""
    if opts.keep_missing:
        try:
            check_keepable(path, leaf)
        except StructureError as e:
            problems.append(str(e))
        return KEEP
    hint = near_miss(path, records) if not problems and opts.transform is None else ""
    problems.append(
        f"leaf {path!r}: expected by like, found no such key in the checkpoint "
        f"(missing='keep' keeps like's value){hint}"
    )
    return None


def check_matched(
    saved: list[str],
    like_paths: list[str] | None,
    renamed: list[str],
    opts: Changes,
    where: str,
    unit: str = "leaf",
) -> None:
    """When a restore reads no saved leaf (``unit="item"``: item) of a checkpoint holding
    values (``saved``): NothingMatchedError, or a WARNING under ``missing="keep_all"``.
    ``like_paths``: like's leaves (None: no like); ``renamed``: after the transform."""
    if not saved:
        return  # an empty checkpoint: nothing to match
    what = f"restore of {where} matched no saved {unit} ({opts.describe()})"
    if opts.missing == "keep_all":  # nothing may match, on purpose
        logger.warning(
            "checkpoint: %s; missing='keep_all' accepts it: every leaf of like keeps its "
            "own value and nothing is read",
            what,
        )
        return
    units = "leaves" if unit == "leaf" else f"{unit}s"
    sides = [f"The checkpoint's {units}: {_some(saved)}"]
    if opts.transform is not None and unit == "leaf":
        sides.append(f"after transform: {_some(renamed)}")
    if like_paths is not None:
        sides.append(f"like's {units}: {_some(like_paths)}")
    result = "nothing" if like_paths is None else "like itself, untouched"
    raise NothingMatchedError(
        f"{what}: it would return {result}. " + "; ".join(sides) + ". Make like's paths "
        "(or transform=) meet the saved ones (fop.metadata lists them); to accept a "
        "restore that matches nothing on purpose, pass missing='keep_all'"
    )


def _some(paths: list[str]) -> str:
    if not paths:
        return "none"
    shown = ", ".join(repr(p) for p in paths[:PATHS_SHOWN])
    return shown + (f" ... ({len(paths)} in all)" if len(paths) > PATHS_SHOWN else "")


def _renamed(message: str, saved: str, path: str) -> str:
    """``message`` about saved leaf ``saved`` naming like's ``path`` too, when renamed."""
    prefix = f"leaf {saved!r}"
    if saved == path or not message.startswith(prefix):
        return message
    return f"leaf {path!r} (saved as {saved!r})" + message[len(prefix) :]


def mismatch(problems: list[str], where: str) -> StructureError:
    """One StructureError listing ``problems`` (the first line names the first one)."""
    if len(problems) == 1:
        return StructureError(f"{problems[0]} at {where}\n{HINT}")
    lines = [
        f"{problems[0]} ({len(problems) - 1} more below)",
        f"like does not match the checkpoint at {where}: {len(problems)} differences:",
        *(f"  {p}" for p in problems[:MAX_LISTED]),
    ]
    if len(problems) > MAX_LISTED:
        lines.append(f"  ... and {len(problems) - MAX_LISTED} more")
    return StructureError("\n".join([*lines, HINT]))
