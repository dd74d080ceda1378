"""FORMAT.md "Version 2" is enough to read the arrays: a reader written from that
section alone (``json``, ``numpy``, a crc32c and file reads; none of this package)
reads every array leaf of checkpoints this library wrote, local and sharded over
processes, and rejects a segment whose bytes do not match the index."""

from __future__ import annotations

import json
import math
import os

import google_crc32c
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop


def _crc(data: bytes) -> int:
    return google_crc32c.value(data)


def read_arrays(path: str) -> dict[str, np.ndarray]:
    """Every uncompressed array leaf stored as its own array, by its path: the index of
    every process merged, each segment checked (offset and length inside its file,
    exactly the chunk's bytes plus 4, its trailer equal to the index's crc32c and to
    the crc32c of the chunk's bytes), the chunks placed (edge chunks cut)."""
    meta = json.load(open(os.path.join(path, "_METADATA.json")))
    assert meta["format_version"] == 2
    chunks, files = {}, {}
    for p in range(meta["process_count"]):
        index = json.load(open(os.path.join(path, "data", f"{p}.json")))
        assert index["format"] == "flax_orbax_plugin/data" and index["process"] == p
        names = [f["name"] for f in index["files"]]
        files.update({f["name"]: f["bytes"] for f in index["files"]})
        for key, (n, offset, length, crc) in index["chunks"].items():
            assert key not in chunks, f"{key} listed twice"
            chunks[key] = (names[n], offset, length, crc)
    out = {}
    for i, leaf in enumerate(meta["leaves"]):
        storage = leaf.get("storage") or {}
        if storage.get("type") != "array" or storage.get("codec"):
            continue
        shape, chunk = tuple(leaf["shape"]), tuple(storage["chunk_shape"])
        dtype = np.dtype(leaf["dtype"]).newbyteorder("<")
        value = np.zeros(shape, dtype)
        grid = [range(-(-s // c)) for s, c in zip(shape, chunk, strict=True)]
        for cell in np.ndindex(*[len(g) for g in grid]) if shape else [()]:
            key = "/".join(["d", str(i), "c", *map(str, cell)]) if shape else f"d/{i}/c/0"
            name, offset, length, crc = chunks[key]
            nbytes = math.prod(chunk) * dtype.itemsize
            assert length == nbytes + 4 and offset + length <= files[name]
            with open(os.path.join(path, "data", name), "rb") as f:
                f.seek(offset)
                segment = f.read(length)
            body, trailer = segment[:-4], int.from_bytes(segment[-4:], "little")
            if trailer != crc or _crc(body) != crc:
                raise ValueError(f"{key}: crc32c mismatch")
            block = np.frombuffer(body, dtype).reshape(chunk)
            at = tuple(
                slice(c * k, min((c + 1) * k, s))
                for c, k, s in zip(cell, chunk, shape, strict=True)
            )
            value[at] = block[tuple(slice(0, a.stop - a.start) for a in at)]
        out[leaf["path"]] = value
    return out


def test_an_independent_reader_reads_the_arrays_of_a_v2_checkpoint(tmp_path, devices):
    mesh = Mesh(np.array(devices).reshape(4, 2), ("x", "y"))
    rng = np.random.default_rng(0)
    tree = {
        "w": jax.device_put(
            rng.random((3000, 700), dtype=np.float32), NamedSharding(mesh, P("x", "y"))
        ),
        "e": rng.integers(0, 99, size=(1025, 1030)).astype(np.int64),  # edge chunks cut
        "h": rng.random((1024, 1100)).astype(np.float16),  # 2.1 MiB: its own array
        "s": np.float32(3.5) * np.ones((), np.float32),
    }
    fop.save(tmp_path / "ck", tree, format_version=2, data_file_bytes=3 << 20)
    got = read_arrays(str(tmp_path / "ck"))
    assert {"w", "e", "h"} <= set(got)
    for k in ("w", "e", "h"):
        np.testing.assert_array_equal(got[k], np.asarray(tree[k]))
    assert len(os.listdir(tmp_path / "ck" / "data")) > 2  # several data files were read


def test_the_independent_reader_rejects_a_damaged_segment(tmp_path):
    fop.save(
        tmp_path / "ck",
        {"w": np.arange(600 * 700, dtype=np.float32).reshape(600, 700)},
        format_version=2,
    )
    data = tmp_path / "ck" / "data" / "0-0.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="crc32c"):
        read_arrays(str(tmp_path / "ck"))
