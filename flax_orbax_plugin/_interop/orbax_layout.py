"""The layout of an Orbax checkpoint, read as data: manager, step and item directories.

A manager directory holds numbered step directories; a step holds
``_CHECKPOINT_METADATA`` and one directory per item; an item holds ``_METADATA``
(each leaf's key path and value type, OCDBT and zarr3 flags) or a JSON item's
``metadata``. :func:`open_orbax` resolves any of them into :class:`OrbaxItem`s, every
metadata field checked (a :class:`CorruptCheckpointError` names the file and field);
nothing below the named path is followed (a link is a :class:`ForeignEntryError`).
Arrays are read by :mod:`.orbax_reader`. Layout and trust rules: ``docs/orbax.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._base import tree as _tree
from .._errors import CheckpointNotFoundError, CorruptCheckpointError
from .._format.foreign import (
    ITEM_METADATA,
    OWN_FILES,
    STEP_METADATA,
    STEP_RE,
    is_step,
    numbered_children,
    subdir,
)
from .._storage.location import Location
from .._storage.untrusted import loads_json

JSON_ITEM_FILE = "metadata"  # what orbax's JsonSave writes
STRINGS_FILE = "_strings.json"
_SEQUENCE_KEY = 1  # orbax's key_type for list/tuple indices; everything else is a dict key
_MAX_JSON_BYTES = 64 << 20
_MAX_KEY_DEPTH = 256  # key path length of one leaf; deeper is malformed metadata


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


def step_dirs(loc: Location) -> dict[int, Location]:
    """{step: directory} of the committed steps of an Orbax manager directory."""
    out = {}
    for step, name in sorted(numbered_children(loc).items()):
        child = subdir(loc, name, "step")
        if child is None:
            continue
        if child.exists(STEP_METADATA) and not any(child.exists(n) for n in OWN_FILES):
            out[step] = child
    return out


def read_json(loc: Location, name: str) -> Any:
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
    doc = read_json(loc, ITEM_METADATA)
    where = f"{loc}/{ITEM_METADATA}"
    tree_meta = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(tree_meta, dict):
        raise CorruptCheckpointError(f"{where}: expected an object with 'tree_metadata'")
    leaves = _leaves(tree_meta, where)
    _check_tree_shape(leaves, where)
    flags = _flags(doc, where)
    use_ocdbt = flags["use_ocdbt"]
    if not use_ocdbt:
        _check_storage_names(leaves, where)
    return OrbaxItem(
        loc,
        name,
        "pytree",
        tuple(leaves),
        use_ocdbt=use_ocdbt,
        use_zarr3=flags["use_zarr3"],
        all_chunks_stored=flags["store_array_data_equal_to_fill_value"],
    )


def _leaves(tree_meta: dict, where: str) -> list[OrbaxLeaf]:
    """The leaves ``_METADATA``'s ``tree_metadata`` lists, each key path and value type
    checked, no path listed twice."""
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
    return leaves


def _flags(doc: dict, where: str) -> dict[str, bool]:
    """``use_ocdbt``, ``use_zarr3`` and ``store_array_data_equal_to_fill_value`` of
    ``_METADATA``: true or false (null or absent: orbax's default)."""
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
    return flags


def _check_storage_names(leaves: list[OrbaxLeaf], where: str) -> None:
    """Without OCDBT each leaf is a directory named by its parameter name: a plain name."""
    for leaf in leaves:
        if leaf.param_name in (".", "..") or "/" in leaf.param_name or "\\" in leaf.param_name:
            raise CorruptCheckpointError(
                f"{where}: leaf {leaf.path!r} names storage {leaf.param_name!r}, "
                f"which is not a plain directory name"
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
    if not is_step(loc):
        dirs = step_dirs(loc)
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
        m = STEP_RE.match(loc.name)
        step = int(m.group(1)) if m else None
    if loc.exists(ITEM_METADATA) or loc.exists(JSON_ITEM_FILE):
        return step, {loc.name: _item(loc, loc.name)}
    record = read_json(loc, STEP_METADATA)
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
        names = [n for n in names if (d := subdir(loc, n, "item")) is not None and _is_item(d)]
    items = {}
    for name in names:
        child = subdir(loc, name, "item")
        if child is not None and child.is_dir():  # an item saved empty leaves no directory
            items[name] = _item(child, name)
    if not items:
        raise CheckpointNotFoundError(f"{loc}: an Orbax step without readable items")
    return step, items


def _plain(name: Any) -> bool:
    """A single path component that stays inside its directory."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )
