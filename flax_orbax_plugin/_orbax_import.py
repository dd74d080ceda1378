"""Reading checkpoints written by orbax-checkpoint, without importing orbax.

Orbax stores each array as a zarr (v2) or zarr3 array through tensorstore, by
default inside one OCDBT key-value database per checkpoint item; its other files
are JSON. This module parses those files as data and opens the arrays with
tensorstore directly:

* an **item** directory (what ``StandardSave`` / ``PyTreeSave`` writes) holds
  ``_METADATA`` (JSON: every leaf's key path and value type, whether OCDBT and
  zarr3 were used), ``manifest.ocdbt`` with ``ocdbt.process_<i>/`` (OCDBT) or one
  directory per leaf (``use_ocdbt=False``), and ``_strings.json`` for string leaves;
  a ``JsonSave`` item holds one JSON file, ``metadata``;
* a **step** directory (what a ``CheckpointManager`` step or a ``Composite``
  save writes) holds ``_CHECKPOINT_METADATA`` (JSON naming each item's handler)
  and one directory per item;
* a **manager** directory holds one step directory per step, named by its number
  (or ``<prefix>_<number>``: ``flax.training.checkpoints`` writes ``checkpoint_100``);
  unfinished saves (``<step>.orbax-checkpoint-tmp-*``) are never listed.

A leaf's array is addressed by its *parameter name*, the key path joined by '.',
exactly as orbax names it. Missing chunks are an error, never zeros, when the
checkpoint says every chunk was stored (``store_array_data_equal_to_fill_value``).
Nothing here unpickles, and no name read from a file can point outside the
checkpoint directory.

Trust rules on local disk: the path the user names is taken as given (it may be
a symlink they chose), but nothing below it is followed. A step directory of a
manager directory, or an item directory of a step, that is a symbolic link is a
:class:`ForeignEntryError` naming it (it could lead into another run); so is a
symbolic link, FIFO, device or socket anywhere inside an item (checked before
tensorstore opens anything, so a FIFO ``manifest.ocdbt`` or data file never
blocks). JSON files are read through :meth:`Location.read_bytes` (regular files
only, ``O_NOFOLLOW | O_NONBLOCK``, at most :data:`_MAX_JSON_BYTES`); malformed
JSON or metadata fields are a :class:`CorruptCheckpointError` naming the file and
the field. An array's claimed size is computed in Python ints and refused above
:data:`_MAX_LEAF_BYTES` before anything is allocated.

Entry points: :func:`is_orbax_checkpoint`, :func:`orbax_steps`,
:func:`restore_orbax` (what ``fop.restore`` calls on an Orbax directory),
:func:`restore_orbax_params` (``fop.restore_params``) and :func:`import_orbax`
(``flax-orbax import``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import tensorstore as ts

from . import _onto_like, _tree
from ._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignEntryError,
    StructureError,
)
from ._importing import loads_json
from ._serving import retarget
from ._storage import Location, context, entry_kind

__all__ = [
    "OrbaxItem",
    "OrbaxLeaf",
    "import_orbax",
    "is_orbax_checkpoint",
    "open_orbax",
    "orbax_steps",
    "restore_orbax",
    "restore_orbax_params",
]

ITEM_METADATA = "_METADATA"  # a pytree item's tree metadata
STEP_METADATA = "_CHECKPOINT_METADATA"  # a step's (or a lone item's) handler record
JSON_ITEM_FILE = "metadata"  # what orbax's JsonSave writes
STRINGS_FILE = "_strings.json"
_OURS = ("_METADATA.json", "_CHECKPOINT.json")  # this plugin's files: never Orbax
# '<step>', or '<prefix>_<step>' as orbax's step_prefix and flax.training.checkpoints
# ('checkpoint_100') name them; unfinished saves ('<name>.orbax-checkpoint-tmp-...') never match.
_STEP_RE = re.compile(r"^(?:[A-Za-z0-9-]+_)?([0-9]+)$")
_SEQUENCE_KEY = 1  # orbax's key_type for list/tuple indices; everything else is a dict key
_MAX_JSON_BYTES = 64 << 20
_MAX_KEY_DEPTH = 256  # key path length of one leaf; deeper is malformed metadata
_MAX_LEAF_BYTES = 1 << 40  # a leaf claiming more is malformed metadata, never allocated


@dataclasses.dataclass(frozen=True)
class OrbaxLeaf:
    """One leaf of an Orbax pytree item, as described by its ``_METADATA``."""

    path: str  # this plugin's leaf path, e.g. 'params/dense/kernel'
    keys: tuple[tuple[str, Any], ...]  # (('dict', 'params'), ('seq', 0), ...)
    value_type: str  # 'jax.Array', 'np.ndarray', 'scalar', 'string', 'None', 'Dict', 'List'
    param_name: str  # orbax's storage name: the keys joined by '.'


@dataclasses.dataclass(frozen=True)
class OrbaxItem:
    """One item of an Orbax checkpoint: a pytree (``leaves``) or a JSON value."""

    location: Location
    name: str
    kind: str  # 'pytree' or 'json'
    leaves: tuple[OrbaxLeaf, ...] = ()
    use_ocdbt: bool = True
    use_zarr3: bool = False
    all_chunks_stored: bool = False

    def __str__(self) -> str:
        return str(self.location)


# -- recognizing and listing ----------------------------------------------------------


def _is_item(loc: Location) -> bool:
    return loc.exists(ITEM_METADATA) or loc.exists(JSON_ITEM_FILE)


def _is_step(loc: Location) -> bool:
    return loc.exists(STEP_METADATA) or loc.exists(ITEM_METADATA)


def is_orbax_checkpoint(path: Any) -> bool:
    """True when ``path`` is an Orbax item, step or manager directory (never one of ours)."""
    try:
        loc = Location.from_path(path)
    except (TypeError, ValueError):
        return False
    if any(loc.exists(name) for name in _OURS):
        return False
    if _is_step(loc):
        return True
    if loc.is_local and not loc.is_dir():
        return False
    numbered = _numbered(loc)
    if not numbered:
        return False
    latest = _subdir(loc, numbered[max(numbered)], "step")  # one look, not one per step
    if latest is None:
        return False
    return latest.exists(STEP_METADATA) and not any(latest.exists(n) for n in _OURS)


def _numbered(loc: Location) -> dict[int, str]:
    """{step: child name} for the children named like steps (not checked further)."""
    out: dict[int, str] = {}
    for name in loc.list_children():
        m = _STEP_RE.match(name)
        if m:
            step = int(m.group(1))
            if step in out:
                raise CorruptCheckpointError(
                    f"{loc}: step {step} appears twice ({out[step]!r} and {name!r})"
                )
            out[step] = name
    return out


def _local_kind(loc: Location, name: str) -> str | None:
    """Local only: what the entry ``name`` of ``loc`` is (``lstat``: no link followed),
    or None when it is absent."""
    try:
        return entry_kind(os.lstat(os.path.join(loc.path, name)).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _subdir(loc: Location, name: str, role: str) -> Location | None:
    """``loc/name`` when it is a real directory; None when it is absent or (on local
    disk) a plain file; ForeignEntryError for a symbolic link (never followed: it could
    lead into another run) or a special file."""
    if not loc.is_local:
        return loc.child(name)
    kind = _local_kind(loc, name)
    if kind is None or kind == "a regular file":
        return None
    if kind != "a directory":
        raise ForeignEntryError(
            f"{loc.child(name)}: expected an Orbax {role} directory, found {kind} "
            f"(never followed or read)"
        )
    return loc.child(name)


def _step_dirs(loc: Location) -> dict[int, Location]:
    """{step: directory} of the committed steps of an Orbax manager directory."""
    out = {}
    for step, name in sorted(_numbered(loc).items()):
        child = _subdir(loc, name, "step")
        if child is None:
            continue
        if child.exists(STEP_METADATA) and not any(child.exists(n) for n in _OURS):
            out[step] = child
    return out


def orbax_steps(path: Any) -> list[int]:
    """Committed steps of an Orbax manager directory (``<step>`` or ``<prefix>_<step>``
    directories holding ``_CHECKPOINT_METADATA``)."""
    return list(_step_dirs(Location.from_path(path)))


def _read_json(loc: Location, name: str) -> Any:
    """A JSON file of the checkpoint: regular files only, never blocking, capped."""
    raw = loc.read_bytes(name, max_bytes=_MAX_JSON_BYTES)
    if raw is None:
        raise CorruptCheckpointError(f"{loc}/{name}: missing")
    return loads_json(raw, f"{loc}/{name}")


def _parse_keys(entry: Any, where: str, max_index: int) -> tuple[tuple[tuple[str, Any], ...], str]:
    keys_meta = entry.get("key_metadata") if isinstance(entry, dict) else None
    if not isinstance(keys_meta, list) or not keys_meta:
        raise CorruptCheckpointError(f"{where}: expected a non-empty key_metadata list")
    if len(keys_meta) > _MAX_KEY_DEPTH:
        raise CorruptCheckpointError(
            f"{where}: key_metadata of {len(keys_meta)} keys; expected at most {_MAX_KEY_DEPTH}"
        )
    keys = []
    for k in keys_meta:
        if not isinstance(k, dict) or not isinstance(k.get("key"), (str, int)):
            raise CorruptCheckpointError(f"{where}: malformed key entry {str(k)[:200]}")
        if k.get("key_type") == _SEQUENCE_KEY:
            try:
                index = int(k["key"])
            except ValueError:
                index = -1
            if not 0 <= index < max_index:
                raise CorruptCheckpointError(
                    f"{where}: key_metadata: sequence key {str(k['key'])[:100]!r} is not an "
                    f"index below {max_index} (the number of leaves)"
                )
            keys.append(("seq", index))
        else:
            keys.append(("dict", str(k["key"])))
    param_name = ".".join(str(k) for _, k in keys)
    return tuple(keys), param_name


def _item(loc: Location, name: str) -> OrbaxItem:
    loc.check_no_links()  # local: no symlink, FIFO or device anywhere in the item
    if not loc.exists(ITEM_METADATA):
        if loc.exists(JSON_ITEM_FILE):
            return OrbaxItem(loc, name, "json")
        raise CheckpointNotFoundError(
            f"{loc}: not an Orbax checkpoint item (expected {ITEM_METADATA} or "
            f"{JSON_ITEM_FILE}; found {', '.join(loc.list_children()) or 'nothing'})"
        )
    doc = _read_json(loc, ITEM_METADATA)
    where = f"{loc}/{ITEM_METADATA}"
    tree_meta = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(tree_meta, dict):
        raise CorruptCheckpointError(f"{where}: expected an object with 'tree_metadata'")
    leaves = []
    seen: set[str] = set()
    for entry in tree_meta.values():
        keys, param_name = _parse_keys(entry, where, len(tree_meta))
        value = entry.get("value_metadata")
        value_type = value.get("value_type") if isinstance(value, dict) else None
        if not isinstance(value_type, str):
            raise CorruptCheckpointError(
                f"{where}: leaf {param_name!r}: value_metadata.value_type: expected a string, "
                f"found {str(value_type)[:100]}"
            )
        path = _tree.path_string(keys)
        if path in seen:
            raise CorruptCheckpointError(f"{where}: leaf {path!r} listed twice")
        seen.add(path)
        leaves.append(OrbaxLeaf(path, keys, value_type, param_name))
    _check_tree_shape(leaves, where)
    flags = {}
    for field, default in (
        ("use_ocdbt", True),
        ("use_zarr3", False),
        ("store_array_data_equal_to_fill_value", False),
    ):
        value = doc.get(field, default)
        if value is None:
            value = default
        if not isinstance(value, bool):
            raise CorruptCheckpointError(
                f"{where}: field {field!r}: expected true or false, found {str(value)[:100]}"
            )
        flags[field] = value
    use_ocdbt = flags["use_ocdbt"]
    if not use_ocdbt:
        for leaf in leaves:
            if leaf.param_name in (".", "..") or "/" in leaf.param_name or "\\" in leaf.param_name:
                raise CorruptCheckpointError(
                    f"{where}: leaf {leaf.path!r} names storage {leaf.param_name!r}, "
                    f"which is not a plain directory name"
                )
    return OrbaxItem(
        loc,
        name,
        "pytree",
        tuple(leaves),
        use_ocdbt=use_ocdbt,
        use_zarr3=flags["use_zarr3"],
        all_chunks_stored=flags["store_array_data_equal_to_fill_value"],
    )


def _check_tree_shape(leaves: list[OrbaxLeaf], where: str) -> None:
    """The leaves' key paths must form a tree: one kind of key (dict or sequence) under
    each node, and no leaf that is also the parent of another leaf."""
    kind_under: dict[tuple, str] = {}
    interior: set[tuple] = set()
    for leaf in leaves:
        for i, (kind, _) in enumerate(leaf.keys):
            prefix = leaf.keys[:i]
            interior.add(prefix)
            if kind_under.setdefault(prefix, kind) != kind:
                raise CorruptCheckpointError(
                    f"{where}: leaf {leaf.path!r}: key_metadata mixes sequence and dict keys "
                    f"under {_tree.path_string(list(prefix))!r}"
                )
    for leaf in leaves:
        if leaf.keys in interior:
            raise CorruptCheckpointError(
                f"{where}: leaf {leaf.path!r} is listed both as a leaf and as the parent of "
                f"other leaves"
            )


def open_orbax(path: Any, *, step: int | None = None) -> tuple[int | None, dict[str, OrbaxItem]]:
    """Resolves an Orbax directory into ``(step, {item name: item})``.

    ``path`` is a manager directory (its latest step, or ``step``), a step
    directory (every item in it) or one item directory (one item named after the
    directory). The step is None when ``path`` is not inside a manager directory.
    """
    loc = Location.from_path(path)
    if not _is_step(loc):
        dirs = _step_dirs(loc)
        if not dirs:
            raise CheckpointNotFoundError(f"{loc}: not an Orbax checkpoint (no steps, no items)")
        if step is None:
            step = max(dirs)
        if step not in dirs:
            raise CheckpointNotFoundError(f"{loc}: no Orbax step {step}; steps: {sorted(dirs)}")
        loc = dirs[step]
    elif step is not None:
        raise ValueError(f"{loc} is one Orbax checkpoint; step={step} does not apply")
    else:
        m = _STEP_RE.match(loc.name)
        step = int(m.group(1)) if m else None
    if loc.exists(ITEM_METADATA) or loc.exists(JSON_ITEM_FILE):
        return step, {loc.name: _item(loc, loc.name)}
    record = _read_json(loc, STEP_METADATA)
    handlers = record.get("item_handlers") if isinstance(record, dict) else None
    if isinstance(handlers, dict):
        names = sorted(handlers)
        for name in names:
            if not _plain(name):
                raise CorruptCheckpointError(
                    f"{loc}/{STEP_METADATA}: item_handlers names item {name[:100]!r}; expected "
                    f"a plain directory name inside the step"
                )
    else:
        names = [n for n in loc.list_children() if not n.startswith((".", "_"))]
        names = [n for n in names if (d := _subdir(loc, n, "item")) is not None and _is_item(d)]
    items = {}
    for name in names:
        child = _subdir(loc, name, "item")
        if child is not None and child.is_dir():  # an item saved empty leaves no directory
            items[name] = _item(child, name)
    if not items:
        raise CheckpointNotFoundError(f"{loc}: an Orbax step without readable items")
    return step, items


# -- reading leaves ---------------------------------------------------------------------


def _plain(name: Any) -> bool:
    """A single path component that stays inside its directory."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )


class _ItemReader:
    """Opens the arrays of one item; one tensorstore context (and so one OCDBT cache)."""

    def __init__(self, item: OrbaxItem):
        self.item = item
        self.context = context(local=item.location.is_local)
        self._strings: dict[str, Any] | None = None

    def spec(self, leaf: OrbaxLeaf) -> dict[str, Any]:
        loc = self.item.location
        if self.item.use_ocdbt:
            kvstore = {"driver": "ocdbt", "base": loc.kvstore(), "path": leaf.param_name + "/"}
        else:
            kvstore = loc.kvstore(leaf.param_name)
        spec = {"driver": "zarr3" if self.item.use_zarr3 else "zarr", "kvstore": kvstore}
        if self.item.all_chunks_stored:
            spec["fill_missing_data_reads"] = False
        return spec

    def open(self, leaf: OrbaxLeaf) -> ts.TensorStore:
        try:
            return ts.open(self.spec(leaf), open=True, context=self.context).result()
        except ValueError as e:
            raise CorruptCheckpointError(
                f"leaf {leaf.path!r} in {self.item}: cannot open its array "
                f"{leaf.param_name!r} (value type {leaf.value_type!r}): {e}"
            ) from e

    def string(self, leaf: OrbaxLeaf) -> str:
        if self._strings is None:
            data = _read_json(self.item.location, STRINGS_FILE)
            if not isinstance(data, dict):
                raise CorruptCheckpointError(f"{self.item}/{STRINGS_FILE}: expected an object")
            self._strings = data
        value = self._strings.get(leaf.param_name)
        if not isinstance(value, str):
            raise CorruptCheckpointError(
                f"leaf {leaf.path!r}: expected a string in {self.item}/{STRINGS_FILE}, "
                f"found {type(value).__name__}"
            )
        return value

    def read(self, leaf: OrbaxLeaf, like: Any, *, allow_cast: bool = False) -> Any:
        """One leaf in the form of ``like`` (see :mod:`_onto_like`)."""
        if leaf.value_type in ("None", "Dict", "List"):
            if like is not None and not (isinstance(like, (dict, list, tuple)) and len(like) == 0):
                raise StructureError(
                    f"leaf {leaf.path!r}: expected {_onto_like.describe(like)} (from like), "
                    f"found an empty {leaf.value_type} in {self.item}"
                )
            return {"None": None, "Dict": {}, "List": []}[leaf.value_type]
        if leaf.value_type == "string":
            value = self.string(leaf)
            if like is not None and not isinstance(like, str):
                raise StructureError(
                    f"leaf {leaf.path!r}: expected {_onto_like.describe(like)} (from like), "
                    f"found a string in {self.item}"
                )
            return value
        store = self.open(leaf)
        shape = tuple(int(d) for d in store.shape)
        nbytes = math.prod(shape) * store.dtype.numpy_dtype.itemsize  # Python ints
        if nbytes > _MAX_LEAF_BYTES:
            raise CorruptCheckpointError(
                f"leaf {leaf.path!r} in {self.item}: its array metadata claims shape "
                f"{list(shape)} ({nbytes} bytes), more than the {_MAX_LEAF_BYTES}-byte limit "
                f"for one leaf; refusing to allocate it"
            )
        plan = _onto_like.plan(
            leaf.path,
            store.shape,
            store.dtype.numpy_dtype,
            like,
            source=str(self.item),
            allow_cast=allow_cast,
            python_scalar=leaf.value_type == "scalar",
        )

        def read(index):
            try:
                return store[index].read().result()
            except ValueError as e:
                raise CorruptCheckpointError(
                    f"leaf {leaf.path!r} in {self.item}: stored data is damaged or missing ({e})"
                ) from e

        try:
            return _onto_like.materialize(plan, read)
        except MemoryError:
            raise CorruptCheckpointError(
                f"leaf {leaf.path!r} in {self.item}: its array metadata claims shape "
                f"{list(shape)} ({nbytes} bytes), more than this host can allocate"
            ) from None


def _select(item: OrbaxItem, like: Any, partial: bool) -> list[tuple[OrbaxLeaf, Any]]:
    """Pairs each leaf to read with its like leaf; StructureError when they do not fit."""
    if like is None:
        return [(leaf, None) for leaf in item.leaves]
    by_path = {leaf.path: leaf for leaf in item.leaves}
    flat, _ = _tree.flatten(like)
    wanted = {p for p, _, _ in flat}
    missing = [p for p in wanted if p not in by_path]
    if missing:
        raise StructureError(
            f"leaf {sorted(missing)[0]!r}: expected by like, found no such key in the Orbax "
            f"checkpoint {item}" + (f" ({len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    if not partial:
        unexpected = [
            leaf.path
            for leaf in item.leaves
            if leaf.path not in wanted and leaf.value_type not in ("None", "Dict", "List")
        ]
        if unexpected:
            raise StructureError(
                f"leaf {unexpected[0]!r}: unexpected key: found in the Orbax checkpoint {item} "
                f"but not in like; pass partial=True to restore a subtree"
            )
    return [(by_path[p], leaf_like) for p, _, leaf_like in flat]


def iter_leaves(
    item: OrbaxItem, like: Any = None, *, partial: bool = False, allow_cast: bool = False
) -> Iterator[tuple[OrbaxLeaf, Any]]:
    """Yields ``(leaf, value)`` one leaf at a time (only one leaf's data is read at once)."""
    if item.kind != "pytree":
        raise StructureError(f"{item} is a JSON item, not a pytree")
    reader = _ItemReader(item)
    for leaf, leaf_like in _select(item, like, partial):
        yield leaf, reader.read(leaf, leaf_like, allow_cast=allow_cast)


def _json_value(item: OrbaxItem) -> Any:
    return _read_json(item.location, JSON_ITEM_FILE)


def _restore_item(item: OrbaxItem, like: Any, partial: bool, allow_cast: bool) -> Any:
    if item.kind == "json":
        return _json_value(item)
    if like is None:
        return _tree.rebuild(
            (list(leaf.keys), value) for leaf, value in iter_leaves(item, allow_cast=allow_cast)
        )
    values = {
        leaf.path: value
        for leaf, value in iter_leaves(item, like, partial=partial, allow_cast=allow_cast)
    }
    flat, treedef = _tree.flatten(like)
    return _tree.unflatten(treedef, [values[p] for p, _, _ in flat])


def restore_orbax(
    path: Any,
    like: Any = None,
    *,
    step: int | None = None,
    partial: bool = False,
    allow_cast: bool = False,
) -> Any:
    """Restores an Orbax checkpoint in the form of ``like`` (rules of ``fop.restore``).

    An item directory gives its tree; a step or manager directory (latest step, or
    ``step``) gives ``{item name: tree or JSON value}``, and ``like`` is then a
    dict of some of its items. Dtype changes must be lossless unless ``allow_cast``.
    """
    loc = Location.from_path(path)
    single = loc.exists(ITEM_METADATA) or (
        loc.exists(JSON_ITEM_FILE) and not loc.exists(STEP_METADATA)
    )
    _, items = open_orbax(loc, step=step)
    if single:
        (item,) = items.values()
        return _restore_item(item, like, partial, allow_cast)
    if like is None:
        return {
            name: _restore_item(item, None, partial, allow_cast) for name, item in items.items()
        }
    if not isinstance(like, Mapping):
        raise StructureError(
            f"{loc} is an Orbax step with items {sorted(items)}: expected like to be a dict "
            f"of items, found {type(like).__name__}"
        )
    unknown = [k for k in like if k not in items]
    if unknown:
        raise StructureError(
            f"item {unknown[0]!r}: expected by like, found no such item in {loc} "
            f"(items: {sorted(items)})"
        )
    if not partial and set(like) != set(items):
        extra = sorted(set(items) - set(like))
        raise StructureError(
            f"item {extra[0]!r}: found in {loc} but not in like; pass partial=True"
        )
    return {k: _restore_item(items[k], v, partial, allow_cast) for k, v in like.items()}


# -- params -------------------------------------------------------------------------------


def _params_source(items: dict[str, OrbaxItem]) -> tuple[OrbaxItem, tuple[str, ...]]:
    """The item holding params and the key prefix of params inside it."""
    if "params" in items and items["params"].kind == "pytree":
        return items["params"], ()
    pytrees = [i for i in items.values() if i.kind == "pytree"]
    for item in pytrees:
        if any(leaf.keys[0] == ("dict", "params") for leaf in item.leaves):
            return item, ("params",)
    if len(pytrees) == 1:
        return pytrees[0], ()
    raise CheckpointNotFoundError(
        f"no params in the Orbax checkpoint {pytrees[0].location.parent if pytrees else ''}: "
        f"no item named 'params' and no item with a top-level 'params' key "
        f"(items: {sorted(items)})"
    )


def restore_orbax_params(
    path: Any,
    like: Any = None,
    *,
    step: int | None = None,
    dtype: Any = None,
    sharding: Any = None,
) -> Any:
    """The params of an Orbax checkpoint, reading nothing else.

    Params are the ``params`` item, else the ``params`` subtree of a pytree item
    (a saved TrainState), else the only pytree item. ``dtype`` casts floating
    leaves (an explicit opt-in to a lossy cast); ``sharding`` is one Sharding or a
    pytree of them.
    """
    _, items = open_orbax(path, step=step)
    item, prefix = _params_source(items)
    if prefix:
        leaves = tuple(
            dataclasses.replace(
                leaf, keys=leaf.keys[1:], path=_tree.path_string(list(leaf.keys[1:]))
            )
            for leaf in item.leaves
            if leaf.keys[0] == ("dict", prefix[0]) and len(leaf.keys) > 1
        )
        item = dataclasses.replace(item, leaves=leaves)
    if like is None and dtype is None and sharding is None:
        return _restore_item(item, None, False, False)
    if like is None:
        reader = _ItemReader(item)
        like = _tree.rebuild((list(leaf.keys), _abstract(reader, leaf)) for leaf in item.leaves)
    if dtype is not None or sharding is not None:
        like = retarget(like, dtype, sharding)
    return _restore_item(item, like, False, dtype is not None)


def _abstract(reader: _ItemReader, leaf: OrbaxLeaf) -> Any:
    if leaf.value_type in ("None", "Dict", "List", "string"):
        return reader.read(leaf, None)
    store = reader.open(leaf)
    return jax.ShapeDtypeStruct(tuple(store.shape), store.dtype.numpy_dtype)


# -- import into a step of this plugin ------------------------------------------------------


def import_orbax(
    src: Any,
    out_dir: Any,
    *,
    step: int | None = None,
    force: bool = False,
) -> list[int]:
    """Writes Orbax checkpoints as steps of a ``CheckpointManager`` directory.

    ``src`` is an Orbax manager directory (every committed step, or only ``step``),
    a step directory or an item directory (written as ``step``, default: the
    directory's own number, else 0). Leaves are read one at a time to host memory
    and the assembled step is saved with the public ``CheckpointManager.save``, so
    the peak is about twice the step's bytes (the tree, then the save's own host
    snapshot). Returns the steps written. Items map as :func:`step_items` says.
    """
    from ._importing import save_steps, step_items

    loc = Location.from_path(src)
    if _is_step(loc):
        own, _ = open_orbax(loc)
        targets = [(step if step is not None else (own if own is not None else 0), loc)]
    else:
        dirs = _step_dirs(loc)
        if not dirs:
            raise CheckpointNotFoundError(f"{loc}: not an Orbax checkpoint (no steps, no items)")
        if step is not None and step not in dirs:
            raise CheckpointNotFoundError(f"{loc}: no Orbax step {step}; steps: {sorted(dirs)}")
        targets = [(s, dirs[s]) for s in (sorted(dirs) if step is None else [step])]

    def states():
        for number, step_loc in targets:
            _, items = open_orbax(step_loc)
            trees = {name: _restore_item(item, None, False, False) for name, item in items.items()}
            kinds = {name: item.kind for name, item in items.items()}
            yield number, step_items(trees, kinds, source=str(step_loc))

    return save_steps(out_dir, states(), force=force, planned=[n for n, _ in targets])
