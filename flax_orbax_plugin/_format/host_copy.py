"""A host's own copy of a step: its marker ``HOST_FILE`` read and checked, and what it holds.
Pure reads of small files; any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._format.host_copy``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .._errors import CheckpointError, CorruptCheckpointError
from .._storage import local_files as _local_files
from .._storage.location import Location
from . import steps as _steps
from .layout import HOST_FILE, ArrayStorage, BatchStorage, iterator_state_file

MARKER_FORMAT = "flax_orbax_plugin/host-copy"
COPY_LAYOUT = "copied down: every region"  # the marker's layout of a bucket's step


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def _pair(d: Any) -> bool:
    return isinstance(d, list) and len(d) == 2 and all(map(_is_int, d))


def _short_str(limit: int):
    """The check of a field that is null or a string of at most ``limit`` characters."""
    return lambda v: v is None or isinstance(v, str) and len(v) <= limit


def _held_ok(held: Any) -> bool:
    """``held``: null, or ``{"sets": [[region, ...], ...], "items": {item: {leaf: set}}}``."""
    if held is None:
        return True
    if not isinstance(held, dict) or set(held) != {"sets", "items"}:
        return False
    sets, items = held["sets"], held["items"]
    region_ok = lambda r: isinstance(r, list) and all(_pair(d) and d[0] <= d[1] for d in r)
    if not isinstance(sets, list) or not all(
        isinstance(s, list) and all(map(region_ok, s)) for s in sets
    ):
        return False
    return isinstance(items, dict) and all(
        isinstance(leaves, dict) and all(_is_int(i) and i < len(sets) for i in leaves.values())
        for leaves in items.values()
    )


# field -> (expected, check) of a per-host marker (what per_host.host_marker writes);
# ``held`` may be absent (a marker written before it was)
_MARKER_FIELDS = {
    "format": (repr(MARKER_FORMAT), lambda v: v == MARKER_FORMAT),
    "step": ("a step number", _is_int),
    "run": ("a run id or null", _short_str(64)),
    "process_index": ("a process index", _is_int),
    "process_count": ("a process count", _is_int),
    "devices": (
        "[[device id, process index], ...]",
        lambda v: isinstance(v, list) and all(map(_pair, v)),
    ),
    "layout": ("a layout description or null", _short_str(256)),
    "hosts": (
        "null or a list of digests",
        lambda v: v is None or isinstance(v, list) and all(isinstance(h, str) for h in v),
    ),
    "held": ("null or {'sets': [...], 'items': {...}} (the regions held)", _held_ok),
}


def read_at(step_loc: Location) -> tuple[dict | None, str | None]:
    """The :data:`HOST_FILE` of the step at ``step_loc`` as a checked JSON object, or what
    is wrong with it (``"no _HOST.json"`` when there is none)."""
    try:
        raw = step_loc.read_bytes(HOST_FILE, max_bytes=_local_files.HOST_MARKER.max_bytes)
        if raw is None:
            return None, f"no {HOST_FILE}"
        doc = _local_files.parse(raw, f"{step_loc}/{HOST_FILE}", _local_files.HOST_MARKER)
    except CheckpointError as e:
        return None, str(e)
    if not isinstance(doc, dict):
        return None, f"{step_loc}/{HOST_FILE}: expected a JSON object, found {type(doc).__name__}"
    for field, (expected, ok) in _MARKER_FIELDS.items():
        if not ok(doc.get(field)):
            found = repr(doc.get(field))[:80]
            return (
                None,
                f"{step_loc}/{HOST_FILE}: field {field}: expected {expected}, found {found}",
            )
    return doc, None


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """One host's copy of a step, as its marker describes it."""

    where: str  # the step's location
    step: int
    process_index: int
    process_count: int
    held: dict | None  # the marker's ``held``: None holds every region

    @property
    def note(self) -> str:
        """What a reader of this copy is told (the verify result's ``note``)."""
        mine = f"process {self.process_index}'s own copy (a directory per host)"
        if self.held is None or not self.held["items"]:
            return f"{mine}, holding every region"
        others = self.process_count - 1
        return f"{mine}: the other {others} host(s)' shards live in their own directories"

    def item(self, name: str) -> HeldItem:
        return HeldItem(self, name)

    def regions(self, item: str, path: str, shape: tuple[int, ...]) -> list[tuple] | None:
        """The regions (tuples of slices) of leaf ``path`` of ``item`` this copy holds (None:
        whole); CorruptCheckpointError for a region outside the leaf's ``shape``."""
        if self.held is None:
            return None
        index = self.held["items"].get(item, {}).get(path)
        if index is None:
            return None
        out = []
        for region in self.held["sets"][index]:
            fits = len(region) == len(shape) and all(
                b <= n for (_, b), n in zip(region, shape, strict=True)
            )
            if not fits:
                raise CorruptCheckpointError(
                    f"{self.where}/{HOST_FILE}: field held: leaf {path!r} of item {item!r} "
                    f"has shape {tuple(shape)}, the marker names the region {region} of it"
                )
            out.append(tuple(slice(a, b) for a, b in region))
        return out

    def partial(self, item: str, records: list) -> list[str]:
        """The paths of ``records`` (of ``item``) this copy does not hold whole."""
        return [r.path for r in records if self.regions(item, r.path, r.shape) is not None]

    def elsewhere(self, kind: str, process_count: int) -> set[str]:
        """Files of an item of ``kind`` held by the other hosts: their data iterator states."""
        if self.held is None or kind != "data_iterator":
            return set()
        others = (p for p in range(process_count) if p != self.process_index)
        return {iterator_state_file(p) for p in others}

    def refusal(self, where: Any, partial: list[str]) -> CheckpointError:
        """The error of a read of ``where`` that needs the leaves ``partial`` whole."""
        shown = ", ".join(repr(p) for p in partial[:3]) + (" ..." if len(partial) > 3 else "")
        return CheckpointError(
            f"{where} is process {self.process_index}'s own copy of step {self.step}, saved "
            f"with a directory per host ({self.process_count} processes): it holds only "
            f"that process's shards of {len(partial)} leaf(s) ({shown}); the other hosts' "
            f"shards live in their own directories. Restore it through the manager on "
            f"every host, or read the persistent tier's copy of the step (it holds every "
            f"shard)"
        )


@dataclasses.dataclass(frozen=True)
class HeldItem:
    """What a host's own copy holds of one item (``verify``'s view of it)."""

    copy: HostCopy
    name: str

    def regions(self, record: Any) -> list[tuple] | None:
        """The regions of ``record``'s leaf held (None: whole; []: none)."""
        return self.copy.regions(self.name, record.path, record.shape)

    def skipped_batches(self, doc: Any) -> set[str]:
        """The batches with a leaf this copy does not hold whole (a host writes a batch only
        when it holds all of its leaves)."""
        return {
            rec.storage.batch
            for rec in doc.leaves
            if isinstance(rec.storage, BatchStorage) and self.regions(rec) is not None
        }

    def whole(self, record: Any, skipped: set[str]) -> bool:
        """Whether the copy holds ``record``'s leaf whole (``skipped``: :meth:`skipped_batches`)."""
        if isinstance(record.storage, BatchStorage):
            return record.storage.batch not in skipped
        return not isinstance(record.storage, ArrayStorage) or self.regions(record) is None


def held_bytes(regions: list[tuple] | None, shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of ``regions`` (None: the whole ``shape``)."""
    if regions is None:
        return math.prod(shape) * itemsize
    return sum(math.prod(s.stop - s.start for s in r) for r in regions) * itemsize


def of_step(step_loc: Location) -> tuple[HostCopy | None, str | None]:
    """The host copy that the local step at ``step_loc`` is (None: no marker there: never
    uploaded), or what is wrong with its marker."""
    if not step_loc.is_local or not step_loc.exists(HOST_FILE):
        return None, None
    doc, problem = read_at(step_loc)
    if doc is None:
        return None, problem
    if _steps.is_step_name(step_loc.name) and doc["step"] != int(step_loc.name):
        found = doc["step"]
        return None, f"{step_loc}/{HOST_FILE}: field step: expected {step_loc.name}, found {found}"
    return HostCopy(
        str(step_loc), doc["step"], doc["process_index"], doc["process_count"], doc.get("held")
    ), None


def of_item(item_loc: Location) -> HostCopy | None:
    """:func:`of_step` of the step holding ``item_loc`` (None where the marker is unreadable:
    the item is then read as any)."""
    return of_step(item_loc.parent)[0]
