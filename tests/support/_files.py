"""Damage for tests: one byte of a file changed in place (same size, same name)."""

from __future__ import annotations

import os


def flip_byte(path, offset: int | None = None) -> None:
    """Inverts the byte of ``path`` at ``offset`` (default: the middle of the file)."""
    offset = os.path.getsize(path) // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
