"""The run record of a place (``_RUN.json``): which run owns it, and who holds it;
read never through a link, and on object stores written only if its generation is
still current (a compare-and-swap). The design: ``docs/run_owner.md``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import Any

from .._errors import CorruptCheckpointError
from . import local_files as _local_files
from .location import Location

RUN_FILE = "_RUN.json"
MAX_RECORD_BYTES = _local_files.RUN_RECORD.max_bytes
_LIBRARY = "flax_orbax_plugin"
_HEX = re.compile(r"^[0-9a-f]{8,64}$", re.ASCII)


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """The owner record of one place (see ``docs/run_owner.md``)."""

    run: str
    host: str
    pid: int
    holder: str
    lease_expires: float | None = None

    @classmethod
    def here(cls, run: str, holder: str, expires: float | None = None) -> RunRecord:
        """The record of ``run`` held by ``holder`` in this process (a lease ending
        ``expires``; None: held by a lock)."""
        return cls(run, socket.gethostname(), os.getpid(), holder, expires)

    def to_bytes(self) -> bytes:
        """The record's JSON; ValueError for a lease time that could not be read back
        (past year 9999), StructureError for one over the reader's limits."""
        if self.lease_expires is not None:
            _local_files.check_time(self.lease_expires, RUN_FILE, "lease_expires", stored=False)
        doc = {"library": _LIBRARY, "kind": "run", **dataclasses.asdict(self)}
        return _local_files.encode(
            doc, RUN_FILE, _local_files.RUN_RECORD, sort_keys=True, separators=None
        )

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> RunRecord:
        """Parses and checks a record; CorruptCheckpointError naming the field."""
        doc = _local_files.parse(raw, where, _local_files.RUN_RECORD)
        if not isinstance(doc, dict):
            raise CorruptCheckpointError(
                f"{where}: expected a JSON object, found {type(doc).__name__}"
            )
        for field, want in (("library", _LIBRARY), ("kind", "run")):
            if doc.get(field) != want:
                raise CorruptCheckpointError(
                    f"{where}: field {field}: expected {want!r}, found {doc.get(field)!r}"
                )
        for field in ("run", "holder"):
            value = doc.get(field)
            if not isinstance(value, str) or not _HEX.match(value):
                raise CorruptCheckpointError(
                    f"{where}: field {field}: expected 8 to 64 lowercase hex digits, "
                    f"found {_short(value)}"
                )
        host, pid, expires = doc.get("host"), doc.get("pid"), doc.get("lease_expires")
        if not isinstance(host, str) or len(host) > 255:
            raise CorruptCheckpointError(
                f"{where}: field host: expected a host name, found {_short(host)}"
            )
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < 1 << 32:
            raise CorruptCheckpointError(
                f"{where}: field pid: expected a process id, found {_short(pid)}"
            )
        if expires is not None:
            expires = _local_files.check_time(expires, where, "lease_expires", stored=True)
        return cls(doc["run"], host, pid, doc["holder"], expires)

    def describe(self) -> str:
        return f"run {self.run} (pid {self.pid} on {self.host})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_record(loc: Location) -> RunRecord | None:
    """The record of ``loc``, or None. Never follows a link (ForeignEntryError); a
    malformed record is a CorruptCheckpointError naming the file and field."""
    raw = loc.read_bytes(RUN_FILE, max_bytes=MAX_RECORD_BYTES)
    return None if raw is None else RunRecord.from_bytes(raw, f"{loc}/{RUN_FILE}")


def read_versioned(loc: Location) -> tuple[RunRecord | None, Any]:
    """Object stores: the record and the storage generation it was read at."""
    raw, generation = loc.read_versioned(RUN_FILE, max_bytes=MAX_RECORD_BYTES)
    record = None if raw is None else RunRecord.from_bytes(raw, f"{loc}/{RUN_FILE}")
    return record, generation


def write_if(loc: Location, record: RunRecord, generation: Any) -> Any | None:
    """Object stores: writes ``record`` only if the stored generation is still
    ``generation``; returns the new generation, or None when someone wrote meanwhile."""
    return loc.write_if(RUN_FILE, record.to_bytes(), generation)
