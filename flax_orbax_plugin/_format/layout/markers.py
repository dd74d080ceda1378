"""The commit records: ``_COMMITTED`` of a core checkpoint, ``_CHECKPOINT.json`` of a
manager step. Both are sealed (a checksum of their own canonical JSON) and carry the
sha256 of every JSON file restore trusts.
"""

from __future__ import annotations

import dataclasses

from ..._errors import CorruptCheckpointError
from ..._storage import json_docs as _docs
from .checked import (
    check_format_version,
    decode,
    files_field,
    int_field,
    is_safe_name,
    need,
    opt_str,
    parse_sealed,
    seal,
    str_field,
    time_field,
)
from .dtypes import MAX_PROCESSES
from .names import (
    COMMIT_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    METADATA_FILE,
    STEP_FORMAT,
    STEP_VERSION,
)

# -- commit records -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommitMarker:
    """``_COMMITTED`` of a standalone core checkpoint: written last; its presence is the
    commit on object stores. Carries the sha256 of ``_METADATA.json``."""

    files: dict[str, str]
    committed_at: float = 0.0

    def to_bytes(self) -> bytes:
        _docs.check_time(self.committed_at, COMMIT_FILE, "committed_at", stored=False)
        return seal(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "committed_at": self.committed_at,
                "files": self.files,
            },
            _docs.COMMIT_MARKER,
        )

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> CommitMarker:
        obj = decode(raw, where, _docs.COMMIT_MARKER)
        if isinstance(obj, dict) and "checksum" not in obj and "files" not in obj:
            raise CorruptCheckpointError(
                f"{where}: a commit marker without checksums (written before format version "
                f"1 was fixed); re-save it with this version"
            )
        body = parse_sealed(raw, where, _docs.COMMIT_MARKER)
        check_format_version(body, where, FORMAT_NAME, "format_version", FORMAT_VERSION)
        files = files_field(body, where)
        need(METADATA_FILE in files, where, "files", f"an entry for {METADATA_FILE}", files)
        return cls(files, time_field(body, "committed_at", where, "committed_at"))


@dataclasses.dataclass(frozen=True)
class ItemEntry:
    """One checkpointable of a step: its kind and the directory holding it."""

    kind: str
    dir: str


@dataclasses.dataclass(frozen=True)
class StepManifest:
    """``<step>/_CHECKPOINT.json``: the one commit of a manager step.

    ``files`` maps every JSON file of the step that restore trusts (relative to the
    step) to its sha256; ``tree_digest`` is the digest all processes agreed on.
    ``bytes_written``/``bytes_reused`` (optional, one-process steps only): array bytes
    the save wrote, and those of unchanged leaves it took from the previous step
    (hard links or server-side copies) instead; informational.
    """

    step: int
    items: dict[str, ItemEntry]
    files: dict[str, str]
    process_count: int = 1
    time: float = 0.0
    tree_digest: str = ""
    bytes_written: int | None = None
    bytes_reused: int | None = None

    def to_bytes(self) -> bytes:
        _docs.check_time(self.time, MANIFEST_FILE, "time", stored=False)
        body = {
            "format": STEP_FORMAT,
            "version": STEP_VERSION,
            "step": self.step,
            "items": {n: {"kind": e.kind, "dir": e.dir} for n, e in self.items.items()},
            "files": self.files,
            "process_count": self.process_count,
            "time": self.time,
            "tree_digest": self.tree_digest,
        }
        if self.bytes_written is not None and self.bytes_reused is not None:
            body["bytes"] = {"written": self.bytes_written, "reused": self.bytes_reused}
        return seal(body, _docs.STEP_MANIFEST)

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> StepManifest:
        body = parse_sealed(raw, where, _docs.STEP_MANIFEST)
        check_format_version(body, where, STEP_FORMAT, "version", STEP_VERSION)
        step = int_field(body, "step", where, "step")
        raw_items = body.get("items")
        need(isinstance(raw_items, dict), where, "items", "an object", raw_items)
        items = {}
        for name, entry in raw_items.items():
            need(is_safe_name(name), where, f"items[{name!r}]", "a safe item name", name)
            need(isinstance(entry, dict), where, f"items[{name!r}]", "an object", entry)
            kind = str_field(entry, "kind", where, f"items[{name!r}].kind")
            d = entry.get("dir")
            need(is_safe_name(d), where, f"items[{name!r}].dir", "a safe directory name", d)
            items[name] = ItemEntry(kind, d)
        dirs = [e.dir for e in items.values()]
        need(len(set(dirs)) == len(dirs), where, "items", "distinct directories", dirs)
        written = reused = None
        if "bytes" in body:
            sizes = body["bytes"]
            need(isinstance(sizes, dict), where, "bytes", "an object", sizes)
            written = int_field(sizes, "written", where, "bytes.written")
            reused = int_field(sizes, "reused", where, "bytes.reused")
        return cls(
            step,
            items,
            files_field(body, where),
            int_field(body, "process_count", where, "process_count", lo=1, hi=MAX_PROCESSES),
            time_field(body, "time", where, "time"),
            opt_str(body, "tree_digest", where),
            written,
            reused,
        )

    def file_checksum(self, item_dir: str, name: str) -> str | None:
        return self.files.get(f"{item_dir}/{name}")
