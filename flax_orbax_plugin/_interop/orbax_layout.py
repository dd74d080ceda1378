"""The layout of an Orbax checkpoint, read as data: :func:`open_orbax` resolves a manager,
step or item directory into :class:`OrbaxItem`s, every metadata field checked; nothing
below the named path is followed. Any thread. Rules: ``docs/orbax.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._base import shown as _shown
from .._base import tree as _tree
from .._errors import CheckpointNotFoundError, CorruptCheckpointError, OptionError
from .._format.foreign import (
    COMMIT_FILE,
    ITEM_METADATA,
    STEP_METADATA,
    STEP_RE,
    is_step,
    legacy_step,
    subdir,
    unfinished,
)
from .._storage.location import Location
from .._storage.untrusted import loads_json
from .orbax_steps import list_steps

JSON_ITEM_FILE = "metadata"  # what orbax's JsonSave writes
STRINGS_FILE = "_strings.json"
_SEQUENCE_KEY = 1  # orbax's key_type for list/tuple indices; everything else is a dict key
_MAX_JSON_BYTES = 64 << 20
_MAX_KEY_DEPTH = 256  # key path length of one leaf; deeper is malformed metadata
_MISSING = (
    f"the step's {STEP_METADATA} names it, but its directory is missing (deleted, or "
    f"the save did not finish)"
)


@dataclasses.dataclass(frozen=True)
class OrbaxLeaf:
    """One leaf of an Orbax pytree item, as described by its ``_METADATA``."""

    path: str  # this plugin's leaf path, e.g. 'params/dense/kernel'
    keys: tuple[tuple[str, Any], ...]  # (('dict', 'params'), ('seq', 0), ...)
    value_type: str  # 'jax.Array', 'np.ndarray', 'scalar', 'string', 'None', 'Dict', 'List'
    param_name: str  # orbax's storage name: the keys joined by '.'


@dataclasses.dataclass(frozen=True)
class OrbaxItem:
    """One item of an Orbax checkpoint: a pytree (``leaves``), a JSON value or a text
    (``file``), or one that cannot be read (``unreadable``: an error when asked for)."""

    location: Location
    name: str
    kind: str  # 'pytree', 'json', 'text', 'unreadable' or 'missing' (named, not there)
    leaves: tuple[OrbaxLeaf, ...] = ()
    use_ocdbt: bool = True
    use_zarr3: bool = False
    all_chunks_stored: bool = False
    file: str = JSON_ITEM_FILE  # the JSON or text file of a 'json' or 'text' item
    unwrap: bool = False  # one array saved alone (ArraySave, a random key): the leaf itself
    as_tuple: bool = False  # numpy's legacy random state: a tuple, as get_state() gives it
    unreadable: str = ""

    def __str__(self) -> str:
        return str(self.location)


def _is_item(loc: Location, name: str) -> bool:
    return loc.exists(ITEM_METADATA) or loc.exists(JSON_ITEM_FILE) or loc.exists(name)


def read_json(loc: Location, name: str) -> Any:
    """A JSON file of the checkpoint: regular files only, never blocking, capped."""
    raw = loc.read_bytes(name, max_bytes=_MAX_JSON_BYTES)
    if raw is None:
        raise CorruptCheckpointError(f"{loc}/{name}: missing")
    return loads_json(raw, f"{loc}/{name}")


def custom_metadata(loc: Location) -> dict[str, Any]:
    """The ``custom_metadata`` of the step (or lone item) at ``loc``; {} when none."""
    if not loc.exists(STEP_METADATA):
        return {}
    record = read_json(loc, STEP_METADATA)
    value = record.get("custom_metadata") if isinstance(record, dict) else None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{loc}/{STEP_METADATA}: field 'custom_metadata': expected an object, found "
            f"{str(value)[:100]}"
        )
    return value


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


# Orbax's handlers by class name (the end of the dotted name its record holds).
_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler", "PyTreeHandler")
_JSON_HANDLERS = ("JsonCheckpointHandler", "JsonHandler", "MetricsHandler")
_TEXT_HANDLERS = ("ProtoCheckpointHandler", "ProtoHandler")
_KEY_HANDLERS = {  # a random key: an array item in a folder, beside a JSON flag
    "JaxRandomKeyCheckpointHandler": "jax_random_key",
    "NumpyRandomKeyCheckpointHandler": "np_random_key",
}


def _item(loc: Location, name: str, handler: str | None = None) -> OrbaxItem:
    """The item at ``loc``, read as its ``handler`` wrote it, else as its files say."""
    loc.check_no_links()  # local: no symlink, FIFO or device anywhere in the item
    short = handler.rsplit(".", 1)[-1] if isinstance(handler, str) else None
    if short in _KEY_HANDLERS:
        return _key_item(loc, name, _KEY_HANDLERS[short])
    if short == "ArrayCheckpointHandler":
        return dataclasses.replace(_pytree_item(loc, name), unwrap=True)
    if short in _JSON_HANDLERS or short in _TEXT_HANDLERS:
        kind = "json" if short in _JSON_HANDLERS else "text"
        return OrbaxItem(loc, name, kind, file=_only_file(loc, f"{short} item"))
    if short in _PYTREE_HANDLERS or loc.exists(ITEM_METADATA):
        return _pytree_item(loc, name)
    for file in (JSON_ITEM_FILE, name):
        if short is None and loc.exists(file):
            return OrbaxItem(loc, name, "json", file=file)
    if short is not None:
        return OrbaxItem(
            loc,
            name,
            "unreadable",
            unreadable=f"written by {short[:100]}, which this reader "
            f"does not know (docs/orbax.md lists what it reads)",
        )
    raise CheckpointNotFoundError(
        f"{loc}: not an Orbax checkpoint item (expected {ITEM_METADATA} or "
        f"{JSON_ITEM_FILE}; found {_shown.listed(loc.list_children(), empty='nothing')})"
    )


def _only_file(loc: Location, what: str) -> str:
    """The one file a JSON or proto item holds besides orbax's marks (hidden ones aside)."""
    if loc.is_local:  # no link or special file is left: check_no_links ran
        files = [n for n, k in loc.child_kinds().items() if k == "file"]
    else:  # a key, not a prefix of keys
        files = [n for n in loc.list_children() if loc.exists(n)]
    files = sorted(n for n in files if n not in (COMMIT_FILE, STEP_METADATA) and n[:1] != ".")
    if len(files) != 1:
        raise CorruptCheckpointError(
            f"{loc}: a {what}: expected one file besides {COMMIT_FILE}, found "
            f"{_shown.listed(files, empty='none')}"
        )
    return files[0]


def _key_item(loc: Location, name: str, folder: str) -> OrbaxItem:
    """A random key item: its array (or numpy's state) in ``folder``, flags beside it."""
    inner = subdir(loc, folder, "item")
    if inner is None:
        raise CorruptCheckpointError(f"{loc}: a random key item without its {folder}/ folder")
    item = _pytree_item(inner, name)
    if folder == "jax_random_key":
        return dataclasses.replace(item, unwrap=True)
    flags = subdir(loc, folder + "_metadata", "item")
    doc = read_json(flags, JSON_ITEM_FILE) if flags is not None else {}
    legacy = doc.get("legacy", False) if isinstance(doc, dict) else None
    if not isinstance(legacy, bool):
        raise CorruptCheckpointError(
            f"{loc}/{folder}_metadata/{JSON_ITEM_FILE}: field 'legacy': expected true or "
            f"false, found {str(legacy)[:100]}"
        )
    return dataclasses.replace(item, as_tuple=legacy)


def _pytree_item(loc: Location, name: str) -> OrbaxItem:
    """A pytree item: its ``_METADATA`` parsed, every field checked."""
    if not loc.exists(ITEM_METADATA):
        raise CorruptCheckpointError(f"{loc}: a pytree item without its {ITEM_METADATA}")
    doc = read_json(loc, ITEM_METADATA)
    where = f"{loc}/{ITEM_METADATA}"
    tree_meta = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(tree_meta, dict):
        raise CorruptCheckpointError(f"{where}: expected an object with 'tree_metadata'")
    leaves = _leaves(tree_meta, where)
    _check_tree_shape(leaves, where)
    flags = _flags(doc, where)
    bad = [x for x in leaves if not flags["use_ocdbt"] and not _plain(x.param_name)]
    if bad:  # without OCDBT each leaf is a directory named by its param_name
        raise CorruptCheckpointError(
            f"{where}: leaf {bad[0].path!r} names storage {bad[0].param_name!r}, "
            f"which is not a plain directory name"
        )
    return OrbaxItem(
        loc,
        name,
        "pytree",
        tuple(leaves),
        use_ocdbt=flags["use_ocdbt"],
        use_zarr3=flags["use_zarr3"],
        all_chunks_stored=flags["store_array_data_equal_to_fill_value"],
    )


def _leaves(tree_meta: dict, where: str) -> list[OrbaxLeaf]:
    """The leaves of ``tree_metadata``, each checked, no path listed twice."""
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
    """The storage flags of ``_METADATA`` (null or absent: orbax's default)."""
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


def _check_tree_shape(leaves: list[OrbaxLeaf], where: str) -> None:
    """The key paths form a tree: one kind of key under each node, no leaf a parent."""
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
    """``(step or None, {item name: item})`` of a manager (latest or ``step``), step or item."""
    loc = Location.from_path(path)
    listing = None if is_step(loc) else list_steps(loc)
    if listing is not None and (listing.steps or not legacy_step(loc)):
        step = listing.choose(step)
        loc = listing.steps[step]
    elif step is not None:  # one step (an older orbax's has no record) or item
        raise OptionError(
            f"step={step}: {loc} is one Orbax checkpoint (a step or an item), not a run of "
            f"steps: step= does not apply; name the run directory, or leave step= out"
        )
    else:
        m = STEP_RE.match(loc.name)
        step = int(m.group(2)) if m else None
    record = read_json(loc, STEP_METADATA) if loc.exists(STEP_METADATA) else None
    why = unfinished(loc, record)
    if why is not None:  # named directly: a run's listing passes those over
        raise CheckpointNotFoundError(
            f"{loc}: an unfinished Orbax save, not read: {why}. Read a finalized step"
        )
    handlers = record.get("item_handlers") if isinstance(record, dict) else None
    if isinstance(handlers, str) or (
        not isinstance(handlers, dict) and (loc.exists(ITEM_METADATA) or loc.exists(JSON_ITEM_FILE))
    ):  # a lone item: its own record names its handler (a str), or none does
        return step, {loc.name: _item(loc, loc.name, handlers)}
    return step, _step_items(loc, handlers)


def _step_items(loc: Location, handlers: Any) -> dict[str, OrbaxItem]:
    """The items its record's ``item_handlers`` names, else every item-like folder."""
    if isinstance(handlers, dict):
        for name in handlers:
            if not _plain(name):
                raise CorruptCheckpointError(
                    f"{loc}/{STEP_METADATA}: item_handlers names item {name[:100]!r}; expected "
                    f"a plain directory name inside the step"
                )
        names = sorted(handlers)
    else:
        names = [n for n in loc.list_children() if not n.startswith((".", "_"))]
        names = [n for n in names if (d := subdir(loc, n, "item")) is not None and _is_item(d, n)]
        handlers = {}
    items = {}
    for name in names:
        child = subdir(loc, name, "item")
        if child is not None and child.is_dir():
            items[name] = _item(child, name, handlers.get(name))
        elif name in handlers:  # named by the record, gone: never read as a whole step
            items[name] = OrbaxItem(loc.child(name), name, "missing", unreadable=_MISSING)
    if not any(item.kind != "missing" for item in items.values()):
        raise CheckpointNotFoundError(f"{loc}: an Orbax step without readable items")
    return items


def _plain(name: Any) -> bool:
    """A single path component that stays inside its directory."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )
