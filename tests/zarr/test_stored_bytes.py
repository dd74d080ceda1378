"""What a save of transformer-shaped leaves costs on disk and on a restore's reads:
the arrays' bytes, not the zero padding of chunks cut by the arrays' ends."""

from __future__ import annotations

import os

import numpy as np

import flax_orbax_plugin as fop
from flax_orbax_plugin._zarr import chunk_files as _chunk_files


def _data_bytes(root) -> int:
    """Bytes of every chunk file under ``root/d`` (version 1: the arrays stored on their
    own), or of the data files under ``root/data`` (version 2)."""
    total = 0
    for parent, _, names in os.walk(os.path.join(root, "d")):
        total += sum(os.path.getsize(os.path.join(parent, n)) for n in names if n != "zarr.json")
    for parent, _, names in os.walk(os.path.join(root, "data")):
        total += sum(os.path.getsize(os.path.join(parent, n)) for n in names if n.endswith(".bin"))
    return total


def test_awkward_shapes_are_stored_and_read_within_a_percent_of_their_bytes(tmp_path):
    """GPT-2-like widths (768, 3072): 4 MiB chunks of 1365 rows stored 3072 rows as
    4095 (33% zero padding, read back whole for its checksums); balanced chunks store
    the bytes and a 4-byte trailer per chunk."""
    rng = np.random.default_rng(0)
    tree = {
        "fc1": rng.standard_normal((768, 3072), dtype=np.float32),  # 9 MiB
        "fc2": rng.standard_normal((3072, 768), dtype=np.float32),
        "embed": rng.standard_normal((5027, 768), dtype=np.float32),  # a vocabulary's odd rows
    }
    arrays = sum(x.nbytes for x in tree.values())
    fop.save(tmp_path / "c", tree)
    stored = _data_bytes(tmp_path / "c")
    assert arrays <= stored <= arrays * 1.01, (stored, arrays)
    before = _chunk_files.bytes_read()
    out = fop.restore(tmp_path / "c", like=tree)
    read = _chunk_files.bytes_read() - before
    assert arrays <= read <= arrays * 1.01, (read, arrays)
    for name, value in tree.items():
        np.testing.assert_array_equal(out[name], value)
