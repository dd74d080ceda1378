"""The files of a checkpoint and a step: their names on disk and the documents they hold.

Records are immutable; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.layout.files``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

from ..._base.key_paths import path_string
from ..._errors import CorruptCheckpointError
from ..._storage import local_files as _local_files
from .records import (
    MAX_PROCESSES,
    BatchRecord,
    BatchStorage,
    LeafRecord,
    check_format_version,
    decode,
    fail,
    files_field,
    int_field,
    need,
    opt_str,
    parse_sealed,
    seal,
    time_field,
)

# -- names on disk --------------------------------------------------------------------------

FORMAT_NAME = "flax_orbax_plugin"
FORMAT_VERSION = 1
LATEST_FORMAT_VERSION = 2  # _METADATA.json: 1 (a file per chunk) or 2 (data files)
STEP_FORMAT = "flax_orbax_plugin/step"
STEP_VERSION = 1
LANES = ("temporary", "permanent", "forced")  # a step's lane (``lanes.Lanes``, a forced save)

METADATA_FILE = "_METADATA.json"
COMMIT_FILE = "_COMMITTED"
MANIFEST_FILE = "_CHECKPOINT.json"
PENDING_FILE = "_PENDING.json"  # a save in progress (or killed): see _core.ownership
HOST_FILE = "_HOST.json"  # in each host's copy of a step (_manager.per_host); never uploaded
JSON_VALUE_FILE = "value.json"
ARRAYS_DIR = "d"  # d/<i>/: the zarr3 array of leaf number i
BATCHES_DIR = "b"  # b/<name>/: a zarr3 1-D batch of small leaves


def array_dir(index: int) -> str:
    """``d/<i>``: where leaf number ``index`` is stored as its own array."""
    return f"{ARRAYS_DIR}/{int(index)}"


def batch_dir(name: str) -> str:
    """``b/<name>``: where the batch ``name`` (``records.batch_name``) is stored."""
    return f"{BATCHES_DIR}/{name}"


def iterator_state_file(process_index: int) -> str:
    """``process_<i>.json``: the data iterator state of process ``process_index``."""
    return f"process_{process_index}.json"


# -- a checkpoint's metadata ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointDocument:
    """``_METADATA.json``: every leaf of one pytree and the batches of small leaves."""

    leaves: tuple[LeafRecord, ...]
    batches: dict[str, BatchRecord]
    process_count: int = 1
    created_at: float = 0.0
    jax_version: str = ""
    format_version: int = FORMAT_VERSION
    # Read, not written: the sha256 of the checkpoint's JSON files its commit recorded,
    # by name (``_format.steps.read_document`` sets it), or None.
    listed: dict[str, str] | None = dataclasses.field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        _local_files.check_time(self.created_at, METADATA_FILE, "created_at", stored=False)
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "created_at": self.created_at,
            "process_count": self.process_count,
            "jax_version": self.jax_version,
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "batches": {name: b.to_json() for name, b in self.batches.items()},
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> CheckpointDocument:
        need(isinstance(obj, dict), where, "the file", "a JSON object", obj)
        version = check_format_version(
            obj, where, FORMAT_NAME, "format_version", LATEST_FORMAT_VERSION
        )
        process_count = int_field(
            obj, "process_count", where, "process_count", lo=1, hi=MAX_PROCESSES
        )
        raw_leaves = obj.get("leaves")
        need(isinstance(raw_leaves, list), where, "leaves", "a list", raw_leaves)
        raw_batches = obj.get("batches")
        need(isinstance(raw_batches, dict), where, "batches", "an object", raw_batches)
        batches = {
            name: BatchRecord.from_json(name, b, where, process_count)
            for name, b in raw_batches.items()
        }
        leaves = tuple(LeafRecord.from_json(r, where, i) for i, r in enumerate(raw_leaves))
        _check_leaves(leaves, batches, where)
        return cls(
            leaves,
            batches,
            process_count,
            time_field(obj, "created_at", where, "created_at"),
            opt_str(obj, "jax_version", where),
            version,
        )


def _check_leaves(leaves: tuple[LeafRecord, ...], batches: dict[str, BatchRecord], where: str):
    seen: set[str] = set()
    limit = 2 * len(leaves)
    tree = _TreeShape()
    for i, leaf in enumerate(leaves):

        def bad(field: str, expected: str, found: Any, leaf=leaf, i=i) -> NoReturn:
            fail(where, f"leaves[{i}] ({leaf.path!r}).{field}", expected, found)

        if leaf.path in seen:
            bad("path", "a path no other leaf has", leaf.path)
        seen.add(leaf.path)
        expected_path = path_string(leaf.keys)
        if leaf.path != expected_path:
            bad("path", f"{expected_path!r} (from its keys)", leaf.path)
        if not leaf.keys and len(leaves) != 1:
            bad("keys", "a key path (only a lone leaf may be the root)", [])
        for kind, key in leaf.keys:
            if kind in ("seq", "flat") and key > limit:
                bad("keys", "indices below the leaf count", key)
        conflict = tree.add(leaf.keys)
        if conflict:
            bad("keys", *conflict)
        storage = leaf.storage
        if isinstance(storage, BatchStorage):
            batch = batches.get(storage.batch)
            if batch is None:
                bad("storage.batch", f"one of {sorted(batches)}", storage.batch)
            held = "uint8" if storage.packed else leaf.dtype  # packed: bytes of a uint8 batch
            if batch.dtype != held:
                bad("storage.batch", f"a batch of dtype {held}", batch.dtype)
            if storage.offset + storage.size > batch.size:
                bad("storage.offset", f"offset + size <= {batch.size}", storage.offset)


class _TreeShape:
    """The nodes that the leaves' key paths make, checked to form one pytree as restore
    rebuilds it: a node's children are all list entries (``seq``/``flat``) or all
    mapping entries (``dict``/``attr``), the keys of one mapping are all ``str`` or all
    ``int`` (jax cannot order mixed keys), and no leaf is also a node. Memory: one
    entry per distinct key path prefix (bounded by the metadata's size)."""

    def __init__(self):
        self._child: dict[tuple[int, str, Any], int] = {}
        self._form: list[Any] = [None]  # per node: None (unseen), "leaf", or (kind, key type)

    def add(self, keys: tuple[tuple[str, Any], ...]) -> tuple[str, Any] | None:
        """Adds one leaf; (expected, found) describing the first conflict, else None."""
        node = 0
        for kind, key in keys:
            form = ("list", int) if kind in ("seq", "flat") else ("map", type(key))
            known = self._form[node]
            if known == "leaf":
                return "a key path under no other leaf", [kind, key]
            if known is None:
                self._form[node] = form
            elif known != form:
                expected = "list entries" if known[0] == "list" else f"{known[1].__name__} keys"
                return f"{expected} like its siblings'", [kind, key]
            slot = (node, form[0], key)
            child = self._child.get(slot)
            if child is None:
                child = self._child[slot] = len(self._form)
                self._form.append(None)
            node = child
        if self._form[node] is not None:
            return "a leaf with no other leaf under it", list(keys[-1]) if keys else []
        self._form[node] = "leaf"
        return None


# -- commit records -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    """``_COMMITTED`` of a standalone core checkpoint: written last; its presence is the
    commit on object stores. Carries the sha256 of ``_METADATA.json``."""

    files: dict[str, str]
    committed_at: float = 0.0

    def to_bytes(self) -> bytes:
        _local_files.check_time(self.committed_at, COMMIT_FILE, "committed_at", stored=False)
        return seal(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "committed_at": self.committed_at,
                "files": self.files,
            },
            _local_files.COMMIT_MARKER,
        )

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> CommitMarker:
        obj = decode(raw, where, _local_files.COMMIT_MARKER)
        if isinstance(obj, dict) and "checksum" not in obj and "files" not in obj:
            raise CorruptCheckpointError(
                f"{where}: a commit marker without checksums (written before format version "
                f"1 was fixed); re-save it with this version"
            )
        body = parse_sealed(raw, where, _local_files.COMMIT_MARKER)
        check_format_version(body, where, FORMAT_NAME, "format_version", FORMAT_VERSION)
        files = files_field(body, where)
        need(METADATA_FILE in files, where, "files", f"an entry for {METADATA_FILE}", files)
        return cls(files, time_field(body, "committed_at", where, "committed_at"))
